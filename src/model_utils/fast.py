"""Speed levers for GPUs, each behind a switch that falls back cleanly (CPU, package missing).

`--fused_kernels auto|on|off`: Liger-Kernel's Triton kernels for Qwen3 (RoPE, RMSNorm, SwiGLU and the fused linear
cross-entropy, which never materialises the full fp32 logits). `auto` uses them with CUDA when `liger-kernel` is
installed; on CPU the model runs unchanged, so CI exercises the same training code path.

Further levers, switched by environment variables (read when the model is built; benchmarks/bench.py sets them per
variant and docs/PERFORMANCE.md records what each one measured):

  DSLM_COMPILE=auto|layers|off   torch.compile each decoder layer in place (regional compilation: one graph shared by
                                 all layers). With it, Liger keeps only the fused linear cross-entropy (Inductor fuses
                                 the norms, RoPE and SwiGLU itself). `auto` = layers (measured +2-3% tokens/s on
                                 an H100 over all-Liger, docs/PERFORMANCE.md). Never
                                 under ZeRO-3 (its parameter hooks live inside the layers) and never without CUDA.
  DSLM_LIGER=auto|all|flce       which Liger kernels `--fused_kernels` applies: all four, or only the fused linear
                                 cross-entropy. `auto`: flce when layers are compiled, else all.
  DSLM_ATTN=auto|fa4|sdpa        attention kernel. `fa4`: FlashAttention-4's CuTe kernels (package flash-attn-4, in the
                                 project's [gpu] and [fa4] extras) for causal attention without a mask on Hopper/Blackwell
                                 (compute capability 9.x/10.x), wrapped as a torch custom op so compiled layers call
                                 it as one opaque kernel; anything else (a padding mask, fp32, another GPU) goes to
                                 SDPA. `auto` = fa4 where it can run (installed, such a GPU, and a first forward and
                                 backward at setup succeeds), else SDPA, whose kernel PyTorch 2.11 picks as cuDNN's on
                                 an H100. On an H100 at the Qwen3-0.6B shape (micro-batch 16) and the trainer's layout
                                 FA4's backward took 5.7 against cuDNN's 6.2 ms (forward 1.8 against 2.0), and training
                                 ran 91.6k against 89.8k tokens/s (docs/PERFORMANCE.md, section 24).
  DSLM_FLCE_CHUNK=auto|1|2|4|8|16
                                 transient-logits budget of Liger's fused linear cross-entropy, in multiples of the
                                 hidden states' size (Liger's chunk_mem_const; Liger's own default is 1). With a
                                 151,936-token vocabulary, 1 means 128 chunks of 256 tokens for a 32k-token batch, and
                                 the bf16 LM-head gradient is read and written once per chunk (~80 GB of memory
                                 traffic per step on Qwen3-0.6B). `auto` = 8: 16 chunks of 2,048 tokens (~0.6 GB
                                 of transient logits).
  DSLM_ACTIVATION_BUDGET=<fraction>
                                 torch.compile's activation memory budget for the compiled layers (a fraction of what
                                 they would save for backward; the cheapest rest is recomputed). 1.0 = off. Default
                                 0.9: on Qwen3-0.6B at micro-batch 8 it cut peak memory from 48.3 to 39.6 GiB at the
                                 same tokens/s (docs/PERFORMANCE.md).
  DSLM_OVERFLOW_CHECK=auto|device|norm|scan
                                 how ZeRO-1/2 (bf16, `check_grad_overflow`) finds a non-finite gradient and skips the
                                 step. `scan`: DeepSpeed's own, a scan of every gradient tensor (amax, amin,
                                 isfinite...: ~7 kernel launches per tensor, ~43 ms of host time per step for
                                 Qwen3-0.6B's 310 tensors, while the GPU idles) and then the host check of the global
                                 gradient norm (stage_1_and_2.step: is_invalid_grad_norm). `norm`: no scan; a
                                 non-finite gradient makes the (all-reduced) norm non-finite, so the host check alone
                                 skips the same steps on every rank. Both make the host wait for the whole backward
                                 pass before it can queue the update. `device`: `norm`, decided on the GPU: the fused
                                 AdamW gets the norm's verdict as its `found_inf` and leaves parameters, moments and
                                 step count untouched when it is set, and the training loop, reading it with its
                                 per-step flags, books the step as DeepSpeed would have (skipped, not applied, the LR
                                 scheduler's step taken back). Needs the gradient norm (zero_optimization.
                                 compute_grad_norm, on by default), no CPU offload, torch's fused Adam/AdamW
                                 (ds_config.json's "torch_adam" + "fused") and a DeepSpeed LR scheduler or none;
                                 otherwise `norm`. `auto` = device.
  DSLM_GRAD_NORM=auto|foreach|deepspeed
                                 how ZeRO-1/2 computes the global gradient norm. DeepSpeed casts each gradient tensor
                                 to fp64 and takes its norm one tensor at a time (two launches and an fp64 copy per
                                 tensor, while the GPU waits at the start of the step); `foreach` takes all norms in
                                 one multi-tensor launch (torch._foreach_norm, returned in fp64; the total in fp32, as
                                 DeepSpeed's) and keeps DeepSpeed's all-reduce and inf/NaN marking. Only without model
                                 or pipeline parallelism. `auto` = foreach.
  DSLM_SDPA=auto|cudnn|flash|efficient|math
                                 SDPA backend tried first (the others stay as fall-backs, so an unsupported shape
                                 still runs). `auto` leaves PyTorch's order.

Under ZeRO-3 the LM head weight is partitioned and Liger's fused loss reads it outside `lm_head.forward`; it is
registered as an external parameter of the top-level module so ZeRO gathers it for the whole forward/backward.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import os

from .arguments import Problem
from .models import head_dim
from .versions import DEEPSPEED_ZERO_STEP, FA4_INTERNALS, LIGER_INTERNALS, gate, installed

COMPILE_CHOICES = ("auto", "layers", "off")
LIGER_CHOICES = ("auto", "all", "flce")
SDPA_CHOICES = ("auto", "cudnn", "flash", "efficient", "math")
ATTN_CHOICES = ("auto", "fa4", "sdpa")
OVERFLOW_CHECK_CHOICES = ("auto", "device", "norm", "scan")
GRAD_NORM_CHOICES = ("auto", "foreach", "deepspeed")
FLCE_CHUNK_CHOICES = ("auto", "1", "2", "4", "8", "16")
FLCE_CHUNK_AUTO = 8
ACTIVATION_BUDGET_DEFAULT = 0.9
FA4_NAME = "dslm_fa4"  # the attention implementation name registered with transformers


def liger_available() -> bool:
    return importlib.util.find_spec("liger_kernel") is not None


def _env_choice(name: str, choices: tuple[str, ...], default: str = "auto") -> str:
    value = os.environ.get(name, default).strip().lower() or default
    if value not in choices:
        raise ValueError(f"{name}={value!r}: expected one of {', '.join(choices)}")
    return value


# Each switch by short name: its choices, and the value that turns its lever off (the libraries' own behaviour; what
# benchmarks/bench.py sets for every lever a variant does not name).
LEVERS = {"compile": (COMPILE_CHOICES, "off"), "liger": (LIGER_CHOICES, "all"), "sdpa": (SDPA_CHOICES, "auto"),
          "attn": (ATTN_CHOICES, "sdpa"), "overflow_check": (OVERFLOW_CHECK_CHOICES, "scan"),
          "grad_norm": (GRAD_NORM_CHOICES, "deepspeed"), "flce_chunk": (FLCE_CHUNK_CHOICES, "1"),
          "activation_budget": (None, "1.0")}


def lever_env(name: str) -> str:
    """The environment variable of the switch `name` ('compile' -> DSLM_COMPILE)."""
    return f"DSLM_{name.upper()}"


def lever_settings() -> dict:
    """The environment switches above, validated, by short name ('compile', 'liger', ..., 'activation_budget')."""
    return {name: _activation_budget() if choices is None else _env_choice(lever_env(name), choices)
            for name, (choices, _) in LEVERS.items()}


def _activation_budget() -> float:
    raw = os.environ.get(lever_env("activation_budget"), "").strip() or str(ACTIVATION_BUDGET_DEFAULT)
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0.0 < value <= 1.0:
        raise ValueError(f"{lever_env('activation_budget')}={raw!r}: expected a fraction in (0, 1]")
    return value


def fused_kernels_problem(setting: str, cuda: bool) -> Problem | None:
    if setting == "on" and not cuda:
        return Problem("--fused_kernels", setting, "the Liger kernels are Triton GPU kernels and there is no GPU here",
                       "use --fused_kernels auto (on where possible) or off")
    if setting == "on" and not liger_available():
        return Problem("--fused_kernels", setting, "liger-kernel is not installed",
                       "pip install liger-kernel (or the project's [gpu] extra), or use --fused_kernels auto/off")
    try:
        settings = lever_settings()
    except ValueError as e:
        return Problem("environment", None, str(e), "unset it or use one of the listed values")
    if settings["attn"] == "fa4" and cuda:
        reason = fa4_unavailable_reason()
        if reason:
            return Problem("DSLM_ATTN", "fa4", reason, "pip install flash-attn-4 on a Hopper/Blackwell GPU, or use "
                           "DSLM_ATTN=auto (SDPA)")
    return None


def use_fused_kernels(setting: str, cuda: bool) -> bool:
    return setting != "off" and cuda and liger_available()


def _is_zero3(model) -> bool:
    return any(hasattr(p, "ds_id") for p in model.parameters())


def use_compile(cuda: bool, zero3: bool, settings: dict | None = None) -> bool:
    settings = settings or lever_settings()
    return settings["compile"] in ("layers", "auto") and cuda and not zero3


def _decoder_layers(model):
    base = getattr(model, getattr(model, "base_model_prefix", "model"), model)
    return getattr(base, "layers", None)


def _compile_layers(model, budget: float, log) -> bool:
    import torch

    layers = _decoder_layers(model)
    if layers is None or not hasattr(torch, "compile"):
        log("compile: no decoder layers found; running eagerly")
        return False
    # One compiled graph serves every layer (identical modules, parameters as inputs); allow a recompile per layer
    # anyway in case a guard specialises on the module, so no layer silently falls back to eager.
    for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit", "accumulated_cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), 4 * len(layers) + 8))
    if budget < 1.0 and hasattr(torch._functorch.config, "activation_memory_budget"):  # torch >= 2.4
        torch._functorch.config.activation_memory_budget = budget
    for layer in layers:
        layer.compile()
    log(f"compile: torch.compile on each of the {len(layers)} decoder layers"
        + (f" (activation memory budget {budget})" if budget < 1.0 else ""))
    return True


def _sdpa_wrap(model, backend: str, log) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    order = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
             "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}
    first = order[backend]
    backends = [first] + [b for b in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                                      SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH) if b != first]
    kwargs = {"set_priority": True} if "set_priority" in inspect.signature(sdpa_kernel).parameters else {}
    inner = model.forward

    @functools.wraps(inner)
    def forward(*args, **kw):
        with sdpa_kernel(backends, **kwargs):
            return inner(*args, **kw)

    model.forward = forward
    log(f"attention: SDPA backend order {[b.name for b in backends]}")


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
    if not gate(FA4_INTERNALS):  # its kernels are called below the package's public wrapper
        return (f"flash-attn-4 {installed('flash-attn-4')} is not {FA4_INTERNALS.oldest}, the version whose kernels "
                "this project calls directly")
    return None


def use_fa4(cuda: bool, model, settings: dict | None = None) -> bool:
    settings = settings or lever_settings()
    if settings["attn"] == "sdpa" or not cuda or getattr(model.config, "_attn_implementation", "sdpa") != "sdpa":
        return False
    dim = head_dim(model.config)
    return dim % 8 == 0 and 8 <= dim <= 256 and fa4_unavailable_reason() is None


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


def takes_document_boundaries(model) -> bool:
    """Whether the model's attention takes documents as boundaries (cu_seq_lens_q: FlashAttention-4) rather than as the
    dense mask transformers builds from position ids that restart at each document (SDPA, eager)."""
    return getattr(model.config, "_attn_implementation", None) == FA4_NAME


def enable_fa4(model, log) -> None:
    _register_fa4()
    model.config._attn_implementation = FA4_NAME
    log("attention: FlashAttention-4 (flash-attn-4 CuTe kernels) for causal attention; SDPA for anything else")


def fa4_probe_failure(model, documents: bool = False) -> str | None:
    """Run one small forward and backward through FlashAttention-4 at the model's head shape (compiling its kernels
    once, as training would; with `documents`, also its variable-length kernels for --document_mask) and return why it
    failed, or None. `auto` falls back to SDPA on a failure, so an environment FA4 does not support (CUDA or driver
    version, a GPU variant) costs speed, not the run."""
    import torch

    config = model.config
    heads, dim = config.num_attention_heads, head_dim(config)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    try:
        _register_fa4()
        boundaries = torch.tensor([0, 100, 256, 300, 512], device="cuda", dtype=torch.int32)  # 2 rows of 2 documents
        for kwargs in [{}] + ([{"cu_seq_lens_q": boundaries, "max_length_q": 256}] if documents else []):
            q = torch.randn(2, heads, 256, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            k, v = (torch.randn(2, kv_heads, 256, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                    for _ in range(2))
            out, _ = fa4_attention(None, q, k, v, None, scaling=dim ** -0.5, is_causal=True, **kwargs)
            out.float().square().mean().backward()
            torch.cuda.synchronize()
            if not all(torch.isfinite(t.grad).all() for t in (q, k, v)):
                return "its probe's gradients were not finite"
    except Exception as e:  # noqa: BLE001  (any failure of this optional kernel means SDPA instead)
        first_line = (str(e).strip().splitlines() or [""])[0]
        return f"{type(e).__name__}: {first_line[:200]}"
    return None


def apply_fused_kernels(model, setting: str, cuda: bool, log, warn=None, documents: bool = False) -> bool:
    """Patch `model` in place with the enabled levers; return whether Liger's kernels are in use. `log` reports what
    was applied (rank 0 is enough: every rank applies the same, except that a rank whose FlashAttention-4 probe fails
    keeps SDPA); `warn` (default `log`) reports that failure, from the rank it happened on. `documents`: the run
    masks attention to documents (--document_mask), so FlashAttention-4's probe covers its variable-length kernels."""
    warn = warn or log
    settings = lever_settings()
    zero3 = _is_zero3(model)
    compiled = use_compile(cuda, zero3, settings)
    liger = use_fused_kernels(setting, cuda)
    if liger:
        which = settings["liger"]
        if which == "auto":
            which = "flce" if compiled else "all"
        if which == "all":
            _apply_liger_all(model, log)
        else:
            _apply_liger_flce_only(model, log)
        if gate(LIGER_INTERNALS, log):
            _set_flce_chunk_budget(flce_chunk_budget(settings), log)
        if zero3:
            _register_lm_head_for_zero3(model, log)
    elif setting == "auto" and cuda:
        log("kernels: liger-kernel is not installed, so the loss materialises full fp32 logits (slower, more memory); "
            "`pip install .[gpu]` adds Liger's kernels")
    if compiled:
        _compile_layers(model, settings["activation_budget"], log)
    if cuda and settings["sdpa"] != "auto" and getattr(model.config, "_attn_implementation", "sdpa") == "sdpa":
        _sdpa_wrap(model, settings["sdpa"], log)  # also the fall-back path of FlashAttention-4
    if use_fa4(cuda, model, settings):
        failure = fa4_probe_failure(model, documents) if settings["attn"] == "auto" else None
        if failure:
            warn(f"attention: FlashAttention-4 failed its setup probe ({failure}); using SDPA (DSLM_ATTN=sdpa skips "
                 "the probe)")
        else:
            enable_fa4(model, log)
    elif (settings["attn"] == "auto" and cuda and getattr(model.config, "_attn_implementation", "sdpa") == "sdpa"
          and (reason := fa4_unavailable_reason())):
        log(f"attention: SDPA ({reason}; on Hopper/Blackwell `pip install .[fa4]` adds FlashAttention-4)")
    return liger


def _liger_entry_point(model):
    """Liger's public apply_liger_kernel_to_<model type>, or None for a model type it has none for."""
    from liger_kernel.transformers import monkey_patch

    return getattr(monkey_patch, f"apply_liger_kernel_to_{getattr(model.config, 'model_type', '')}", None)


def _apply_liger_all(model, log):
    """All of Liger's kernels on this model instance: through its public entry point for the model type, or, for
    types without one, its generic instance patching (private: only on the liger-kernel versions tested)."""
    fn = _liger_entry_point(model)
    if fn is not None:
        fn(model=model)
    elif gate(LIGER_INTERNALS, log):
        from liger_kernel.transformers import _apply_liger_kernel_to_instance

        _apply_liger_kernel_to_instance(model=model)
    else:
        log(f"kernels: Liger has no entry point for {model.config.model_type!r}; its kernels are not applied")
        return
    log("kernels: Liger fused RoPE, RMSNorm, SwiGLU and linear cross-entropy enabled")


def _apply_liger_flce_only(model, log):
    fn = _liger_entry_point(model)
    if fn is None:
        log(f"kernels: no Liger entry point for {model.config.model_type!r} alone; trying all Liger kernels")
        _apply_liger_all(model, log)
        return
    fn(rope=False, rms_norm=False, swiglu=False, cross_entropy=False, fused_linear_cross_entropy=True, model=model)
    log("kernels: Liger fused linear cross-entropy enabled (norms, RoPE, SwiGLU left to torch.compile)")


@functools.cache
def _liger_flce_original():
    from liger_kernel.transformers import functional

    return functional.liger_fused_linear_cross_entropy


def flce_chunk_budget(settings: dict | None = None) -> int:
    """DSLM_FLCE_CHUNK as Liger's chunk_mem_const (also what preflight's memory estimate counts)."""
    setting = (settings or lever_settings())["flce_chunk"]
    return FLCE_CHUNK_AUTO if setting == "auto" else int(setting)


def _set_flce_chunk_budget(budget: int, log) -> None:
    """Make `chunk_mem_const` the default of the function Liger's model losses call (looked up at call time)."""
    from liger_kernel.transformers import functional

    original = _liger_flce_original()
    if "chunk_mem_const" not in inspect.signature(original).parameters:
        log("kernels: this liger-kernel has no chunk_mem_const; its fused cross-entropy keeps its own chunking")
        return

    @functools.wraps(original)  # keeps the signature, which Liger's loss inspects to filter its kwargs
    def fused_linear_cross_entropy(*args, chunk_mem_const: int = budget, **kwargs):
        return original(*args, chunk_mem_const=chunk_mem_const, **kwargs)

    functional.liger_fused_linear_cross_entropy = fused_linear_cross_entropy
    log(f"kernels: fused linear cross-entropy chunked for {budget}x the hidden states' size of transient logits")


def _register_lm_head_for_zero3(model, log):
    head = getattr(model, "lm_head", None)
    if head is None or not hasattr(head.weight, "ds_id"):
        return
    from deepspeed.runtime.zero import register_external_parameter

    register_external_parameter(model, head.weight)
    log("kernels: ZeRO-3 gathers the LM head weight for Liger's fused loss (external parameter of the model)")


def streamline_zero_step(engine, log) -> bool:
    """The ZeRO-1/2 step's host-bound parts: DSLM_OVERFLOW_CHECK=device (or norm) and DSLM_GRAD_NORM=foreach (all
    `auto`). Returns whether any was applied."""
    try:
        from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    except ImportError:
        return False
    opt = getattr(engine, "optimizer", None)
    if not isinstance(opt, DeepSpeedZeroOptimizer) or not gate(DEEPSPEED_ZERO_STEP, log):
        return False
    settings = lever_settings()
    applied = False
    if settings["grad_norm"] != "deepspeed":
        applied |= _foreach_grad_norm(opt, engine.module, log)
    if settings["overflow_check"] != "scan" and _norm_overflow_check(opt, log):
        applied = True
        if settings["overflow_check"] in ("auto", "device"):
            _device_overflow_skip(engine, log)
    return applied


def _norm_overflow_check(opt, log) -> bool:
    """Let the global gradient norm, not a per-tensor scan, find non-finite gradients."""
    applicable = (getattr(opt, "check_grad_overflow", False) and getattr(opt, "compute_grad_norm", False)
                  and not getattr(opt, "cpu_offload", True) and callable(getattr(opt, "check_overflow", None)))
    if not applicable:
        return False
    # DeepSpeedZeroOptimizer.step sets overflow = False, calls check_overflow, then marks the step overflowed when the
    # (all-reduced) norm is inf/NaN; a no-op check leaves that second test as the only one.
    opt.check_overflow = lambda partition_gradients=True: None
    log("zero: non-finite gradients found through the global gradient norm (per-tensor overflow scan skipped)")
    return True


_CHECKED_ON_DEVICE = "_dslm_checked_on_device"  # marks a norm tensor whose validity the GPU itself acts on


def _device_overflow_skip(engine, log) -> None:
    """DSLM_OVERFLOW_CHECK=device: the verdict on the global norm goes to the fused AdamW as `found_inf` instead of
    to the host. DeepSpeed's step then runs on as if the norm were valid: its clipping scales the (non-finite)
    gradients by 1/inf, the optimizer leaves everything untouched, and the bf16 copy rewrites unchanged weights."""
    import torch
    from deepspeed.runtime.zero import stage_1_and_2

    opt = engine.optimizer
    inner, scheduler = getattr(opt, "optimizer", None), getattr(engine, "lr_scheduler", None)
    applicable = (isinstance(inner, (torch.optim.Adam, torch.optim.AdamW))
                  and all(group.get("fused") for group in inner.param_groups)
                  and getattr(opt, "dtype", None) == torch.bfloat16 and not getattr(opt, "torch_autocast_gradscaler", None)
                  and callable(getattr(stage_1_and_2, "is_invalid_grad_norm", None))
                  and (scheduler is None or hasattr(scheduler, "last_batch_iteration")))
    if not applicable:
        log("zero: the step's overflow verdict stays on the host (DSLM_OVERFLOW_CHECK=device needs torch's fused "
            "AdamW, bf16 and a DeepSpeed LR scheduler)")
        return
    _host_skips_norms_checked_on_device()
    original = opt.scaled_global_norm

    def scaled_global_norm(norm_type=2):
        norm = original(norm_type)
        invalid = ~torch.isfinite(norm) | (norm < 0)  # as is_invalid_grad_norm (-1 is DeepSpeed's inf/NaN mark)
        inner.found_inf = invalid.float()  # read by torch's fused Adam(W) kernel: skip the whole update when 1
        opt.dslm_step_skipped = invalid
        setattr(norm, _CHECKED_ON_DEVICE, True)
        return norm

    opt.scaled_global_norm = scaled_global_norm
    log("zero: a step with non-finite gradients is skipped by the GPU (fused AdamW found_inf); the host learns of it "
        "at the loop's per-step flags")


@functools.cache
def _host_skips_norms_checked_on_device() -> None:
    """stage_1_and_2 asks is_invalid_grad_norm (a host synchronisation) in step() and again in its clipping; for a
    norm whose verdict already went to the optimizer the answer is 'valid' (the invalid case is handled on device)."""
    from deepspeed.runtime.zero import stage_1_and_2

    original = stage_1_and_2.is_invalid_grad_norm

    def is_invalid_grad_norm(norm):
        return False if getattr(norm, _CHECKED_ON_DEVICE, False) else original(norm)

    stage_1_and_2.is_invalid_grad_norm = is_invalid_grad_norm


def device_skip_flag(engine, device):
    """1.0 (a device tensor, not yet read) when DSLM_OVERFLOW_CHECK=device had the GPU skip the last update, else 0."""
    import torch

    flag = getattr(engine.optimizer, "dslm_step_skipped", None)
    return flag.float() if flag is not None else torch.zeros((), device=device)


def settle_device_skip(engine) -> None:
    """Book an update the GPU skipped as DeepSpeed books one it skips on the host: a skipped step, not applied, the
    norm reported as inf, and the LR scheduler's step (taken as if the update had been applied) taken back."""
    engine.skipped_steps += 1
    engine._step_applied = False
    engine._global_grad_norm = engine.optimizer._global_grad_norm = float("inf")
    if engine.lr_scheduler is not None:
        engine.lr_scheduler.step(engine.lr_scheduler.last_batch_iteration - 1)


def _foreach_grad_norm(opt, module, log) -> bool:
    """Replace get_grad_norm_direct (an fp64 copy and a norm per gradient tensor) by one multi-tensor norm, keeping
    its all-reduce and its -1 marking of an inf/NaN norm. Only where every rank counts every gradient it holds: no
    model parallel group and no pipeline-replicated parameters (DeepSpeed's filters for those are not repeated)."""
    import torch

    original = getattr(opt, "get_grad_norm_direct", None)
    if (original is None or not hasattr(torch, "_foreach_norm") or getattr(opt, "model_parallel_group", None) is not None
            or any(getattr(p, "ds_pipe_replicated", False) for p in module.parameters())):
        return False
    from deepspeed import comm as dist
    from deepspeed.runtime.utils import mask_nan_or_inf_with_val_inplace
    from deepspeed.runtime.zero.utils import get_norm_dtype

    def get_grad_norm_direct(gradients, params, norm_type=2):
        grads = [g.detach() for g in gradients if not getattr(g, "_zero_padding", False)]
        if float(norm_type) != 2.0 or not grads:
            return original(gradients, params, norm_type)
        norms = torch._foreach_norm(grads, 2.0, dtype=get_norm_dtype())
        total = torch.stack(norms).pow(2).sum().float()
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=opt.dp_process_group)
        total = total.pow(0.5)
        mask_nan_or_inf_with_val_inplace(total, device=opt.device)
        return total

    opt.get_grad_norm_direct = get_grad_norm_direct
    log("zero: global gradient norm in one multi-tensor launch (torch._foreach_norm)")
    return True
