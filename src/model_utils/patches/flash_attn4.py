"""FlashAttention-4 as the attention kernel of transformers' models.

The flash-attn-4 pre-release's autograd wrapper is not compilable as one opaque kernel; its forward and backward
kernels (`flash_attn.cute.interface._flash_attn_fwd` / `_flash_attn_bwd`) are wrapped here as torch custom ops
(forward, backward, fake shapes), so the compiled decoder layers call them without a graph break, and registered as a
transformers attention implementation whose mask function is SDPA's: anything FA4 does not cover (a padding mask,
fp32, non-causal attention, another GPU) goes to SDPA.
"""

from __future__ import annotations

import functools
import importlib
import os

from model_utils.patches import Patch, gate, installed

FA4_KERNELS = Patch(
    "flash-attn-4", "4.0.0b36", "4.0.0b36",
    "flash_attn.cute.interface._flash_attn_fwd and _flash_attn_bwd: called below the package's autograd wrapper, as "
    "the torch custom ops dslm::fa4_forward/backward and dslm::fa4_varlen_forward/backward",
    "faster attention than SDPA's kernels within documents (docs/PERFORMANCE.md, Attention within documents); the "
    "loss check against the unfused SDPA path stays within bf16 noise",

    ("tests/unit/patches/test_patches.py::test_fa4_attention_wrapper_layout_and_fallbacks",
     "tests/unit/patches/test_patches.py::test_fa4_attention_takes_documents_as_boundaries",
     "tests/unit/patches/test_patches.py::test_fa4_probe_compiles_both_variants_of_the_variable_length_kernels"))
FA4_NAME = "dslm_fa4"  # the attention implementation name registered with transformers


def fa4_unavailable_reason() -> str | None:
    """None when FlashAttention-4 can run here, else why not (package missing, no GPU, unsupported GPU)."""
    import torch

    if not torch.cuda.is_available():
        return "FlashAttention-4 needs a CUDA GPU and there is none here"
    major, minor = torch.cuda.get_device_capability()
    if major not in (9, 10):
        return f"FlashAttention-4 runs on compute capability 9.x/10.x; this GPU is {major}.{minor}"
    # Keep the kernels FA4 JIT-compiles on disk (file-locked, per user), so ranks and restarts reuse them.
    os.environ.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "1")
    try:
        importlib.import_module("flash_attn.cute.interface")
    except ImportError as e:  # the package, or one of its CUDA libraries, is missing
        return f"flash-attn-4 is not importable ({e})"
    if not gate(FA4_KERNELS):  # its kernels are called below the package's public wrapper
        return (f"flash-attn-4 {installed('flash-attn-4')} is not {FA4_KERNELS.oldest}, the version whose kernels "
                "this project calls directly")
    return None


_fa4_kernel = None  # torch.ops.dslm.fa4_forward once registered: (q, k, v, scale) in (batch, seq, heads, dim)
_fa4_varlen_kernel = None  # torch.ops.dslm.fa4_varlen_forward: (q, k, v, cu_seqlens, max_seqlen, scale), (tokens, heads, dim)


def fa4_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, sliding_window=None,
                  softcap=None, **kwargs):
    """transformers' attention signature: (batch, heads, seq, head_dim) in, (batch, seq, heads, head_dim) out.
    Causal self-attention without a mask goes to FlashAttention-4, and so does attention within documents when the
    caller gives their boundaries as `cu_seq_lens_q` (the trainer's --document_mask; the dense mask transformers built
    from the same position ids is then not needed); anything else to SDPA, with transformers' mask."""
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    causal = kwargs.get("is_causal")
    causal = getattr(module, "is_causal", True) if causal is None else causal
    documents = kwargs.get("cu_seq_lens_q")
    if ((attention_mask is not None and documents is None) or dropout or sliding_window or softcap or not causal
            or query.dtype not in (torch.bfloat16, torch.float16) or query.shape[2] != key.shape[2]):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      sliding_window=sliding_window, softcap=softcap, **kwargs)
    scale = float(scaling if scaling is not None else query.shape[-1] ** -0.5)
    # FA4 takes (batch, seq, heads, head_dim); the contiguous copies fuse into the producing kernels when compiled.
    q, k, v = (t.transpose(1, 2).contiguous() for t in (query, key, value))
    if documents is None:
        out, _ = _fa4_kernel(q, k, v, scale)
        return out, None
    batch, seq = q.shape[:2]
    out, _ = _fa4_varlen_kernel(*(t.view(batch * seq, *t.shape[2:]) for t in (q, k, v)), documents,
                                int(kwargs.get("max_length_q") or seq), scale)
    return out.view(batch, seq, *out.shape[1:]), None


@functools.cache
def _register_fa4() -> None:
    """Register FlashAttention-4 as a torch custom op (forward, backward, fake shapes) and as a transformers
    attention implementation whose mask function is SDPA's, so anything FA4 does not cover falls back to SDPA."""
    import torch
    from flash_attn.cute import interface as fa
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    # Explicit schemas: this module's postponed annotations are strings that torch's schema inference cannot read.
    @torch.library.custom_op("dslm::fa4_forward", mutates_args=(), device_types="cuda",
                             schema="(Tensor q, Tensor k, Tensor v, float scale) -> (Tensor, Tensor)")
    def fa4_forward(q, k, v, scale):
        out, lse = fa._flash_attn_fwd(q, k, v, softmax_scale=scale, causal=True, return_lse=True)[:2]
        return out.contiguous(), lse.contiguous()

    @fa4_forward.register_fake
    def _(q, k, v, scale):
        b, t, h, _ = q.shape
        return q.new_empty(b, t, h, v.shape[-1]), q.new_empty(b, h, t, dtype=torch.float32)

    @torch.library.custom_op("dslm::fa4_backward", mutates_args=(), device_types="cuda",
                             schema="(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, float scale)"
                                    " -> (Tensor, Tensor, Tensor)")
    def fa4_backward(dout, q, k, v, out, lse, scale):
        dq, dk, dv = fa._flash_attn_bwd(q, k, v, out, dout.contiguous(), lse, scale, True,
                                        deterministic=torch.are_deterministic_algorithms_enabled())[:3]
        return dq.contiguous(), dk.contiguous(), dv.contiguous()

    @fa4_backward.register_fake
    def _(dout, q, k, v, out, lse, scale):
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    def setup_context(ctx, inputs, output):
        q, k, v, scale = inputs
        ctx.save_for_backward(q, k, v, *output)
        ctx.scale = scale

    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        return (*torch.ops.dslm.fa4_backward(dout, q, k, v, out, lse, ctx.scale), None)

    fa4_forward.register_autograd(backward, setup_context=setup_context)

    # Documents packed in a batch (--document_mask): q, k, v as (tokens, heads, dim) with the documents' boundaries
    # (cu_seqlens, int32, their number varying per batch) and the longest possible document (the block length).
    @torch.library.custom_op("dslm::fa4_varlen_forward", mutates_args=(), device_types="cuda",
                             schema="(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens, int max_seqlen, float scale)"
                                    " -> (Tensor, Tensor)")
    def fa4_varlen_forward(q, k, v, cu_seqlens, max_seqlen, scale):
        out, lse = fa._flash_attn_fwd(q, k, v, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens,
                                      max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen, softmax_scale=scale,
                                      causal=True, return_lse=True)[:2]
        return out.contiguous(), lse.contiguous()

    @fa4_varlen_forward.register_fake
    def _(q, k, v, cu_seqlens, max_seqlen, scale):
        t, h, _ = q.shape
        return q.new_empty(t, h, v.shape[-1]), q.new_empty(h, t, dtype=torch.float32)

    @torch.library.custom_op("dslm::fa4_varlen_backward", mutates_args=(), device_types="cuda",
                             schema="(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
                                    "Tensor cu_seqlens, int max_seqlen, float scale) -> (Tensor, Tensor, Tensor)")
    def fa4_varlen_backward(dout, q, k, v, out, lse, cu_seqlens, max_seqlen, scale):
        dq, dk, dv = fa._flash_attn_bwd(q, k, v, out, dout.contiguous(), lse, scale, True,
                                        cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens, max_seqlen_q=max_seqlen,
                                        max_seqlen_k=max_seqlen,
                                        deterministic=torch.are_deterministic_algorithms_enabled())[:3]
        return dq.contiguous(), dk.contiguous(), dv.contiguous()

    @fa4_varlen_backward.register_fake
    def _(dout, q, k, v, out, lse, cu_seqlens, max_seqlen, scale):
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    def setup_varlen_context(ctx, inputs, output):
        q, k, v, cu_seqlens, max_seqlen, scale = inputs
        ctx.save_for_backward(q, k, v, cu_seqlens, *output)
        ctx.max_seqlen, ctx.scale = max_seqlen, scale

    def varlen_backward(ctx, dout, _dlse):
        q, k, v, cu_seqlens, out, lse = ctx.saved_tensors
        grads = torch.ops.dslm.fa4_varlen_backward(dout, q, k, v, out, lse, cu_seqlens, ctx.max_seqlen, ctx.scale)
        return (*grads, None, None, None)

    fa4_varlen_forward.register_autograd(varlen_backward, setup_context=setup_varlen_context)

    global _fa4_kernel, _fa4_varlen_kernel
    _fa4_kernel = torch.ops.dslm.fa4_forward
    _fa4_varlen_kernel = torch.ops.dslm.fa4_varlen_forward
    AttentionInterface.register(FA4_NAME, fa4_attention)
    AttentionMaskInterface.register(FA4_NAME, sdpa_mask)


def enable_fa4(model, log) -> None:
    _register_fa4()
    model.config._attn_implementation = FA4_NAME
    log("attention: FlashAttention-4 (flash-attn-4 CuTe kernels) for causal attention; SDPA for anything else")


# FlashAttention-4 compiles its variable-length kernels (forward, backward and their pre/post passes) in one variant
# for batches of up to this many sequences and in another, with a batch-lookup aid, above it
# (flash_attn.cute.interface.BIN_BATCH_SEARCH_THRESH in 4.0.0b36). Packed chats of ~150 tokens put more than 256
# examples into a micro-batch of 16 x 2048 tokens now and then, and the first such micro-batch would compile the second
# variant inside a training step (~11 s; docs/PERFORMANCE.md, Fine-tuning), so the probe compiles both.
FA4_VARLEN_SCHEDULER_THRESHOLD = 256
_PROBE_TOKENS = 512  # the probe's batch: 2 rows of 256 tokens


def probe_document_boundaries() -> list[list[int]]:
    """The probe's variable-length batches as their documents' boundaries over its 2 rows of 256 tokens, each row's
    documents within it as the trainer's are: 2 documents a row, and more documents than FlashAttention-4's scheduler
    threshold (in each row 149 of one token and the rest of the row in one: 300 in all)."""
    row = _PROBE_TOKENS // 2
    many = [*range(0, 150), row, *range(row + 1, row + 150), _PROBE_TOKENS]
    return [[0, 100, row, row + 44, _PROBE_TOKENS], many]


def fa4_probe_failure(model, documents: bool = False) -> str | None:
    """Run one small forward and backward through FlashAttention-4 at the model's head shape (compiling its kernels
    once, as training would; with `documents`, also its variable-length kernels for --document_mask and packed
    examples, in both of their variants: probe_document_boundaries) and return why it failed, or None. `auto` falls
    back to SDPA on a failure, so an environment FA4 does not support (CUDA or driver version, a GPU variant) costs
    speed, not the run."""
    import torch

    config = model.config
    heads = config.num_attention_heads
    dim = getattr(config, "head_dim", None) or config.hidden_size // heads  # as models.build.head_dim
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    try:
        _register_fa4()
        varlen = [{"cu_seq_lens_q": torch.tensor(b, device="cuda", dtype=torch.int32), "max_length_q": 256}
                  for b in probe_document_boundaries()] if documents else []
        for kwargs in [{}] + varlen:
            q = torch.randn(2, heads, _PROBE_TOKENS // 2, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            k, v = (torch.randn(2, kv_heads, _PROBE_TOKENS // 2, dim, device="cuda", dtype=torch.bfloat16,
                                requires_grad=True) for _ in range(2))
            out, _ = fa4_attention(None, q, k, v, None, scaling=dim ** -0.5, is_causal=True, **kwargs)
            out.float().square().mean().backward()
            torch.cuda.synchronize()
            if not all(torch.isfinite(t.grad).all() for t in (q, k, v)):
                return "its probe's gradients were not finite"
    except Exception as e:  # noqa: BLE001  (any failure of this optional kernel means SDPA instead)
        first_line = (str(e).strip().splitlines() or [""])[0]
        return f"{type(e).__name__}: {first_line[:200]}"
    return None
