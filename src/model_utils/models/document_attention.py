"""Attention within documents (packed fine-tuning examples, --document_mask) without a dense mask.

Positions that restart at each document make transformers build a (batch, 1, seq, seq) boolean mask for SDPA, which
keeps SDPA off its flash kernel and computes every query-key pair across documents only to mask it. Where
FlashAttention-4 does not run (every GPU before Hopper, or without the package), the documents' boundaries
(`cu_seq_lens_q`, FlashAttention's cu_seqlens over the flattened batch) go instead to

  varlen         `torch.nn.attention.varlen.varlen_attn`: PyTorch's own variable-length FlashAttention kernels, from
                 compute capability 8.0 (Ampere, Ada, Hopper, Blackwell), no extra package;
  sdpa-documents one causal SDPA call per document (`document_sdpa`, any device; also sequence parallelism's path).

Each is registered with transformers under its own name without a mask function, so transformers builds no mask.
A model whose attention needs one (a sliding window shorter than the sequence, soft-capped logits, attention dropout)
keeps SDPA with transformers' mask, and the run's log says why. tests/unit/models/test_document_attention.py holds
both paths equal to the dense-mask path in outputs and gradients.
"""

from __future__ import annotations

import functools
import inspect

from model_utils.patches.flash_attn4 import FA4_NAME

VARLEN_NAME = "dslm_varlen"  # the attention implementations registered with transformers
SDPA_DOCUMENTS_NAME = "dslm_sdpa_documents"
KERNEL_NAMES = {"varlen": VARLEN_NAME, "sdpa-documents": SDPA_DOCUMENTS_NAME}
KERNEL_LABELS = {"fa4": "FlashAttention-4", "varlen": "PyTorch's variable-length FlashAttention (varlen_attn)",
                 "sdpa-documents": "SDPA once per document", "sdpa": "SDPA"}


def varlen_unavailable_reason() -> str | None:
    """None where torch's varlen_attn runs here, else why not."""
    import torch

    if not torch.cuda.is_available():
        return "PyTorch's variable-length attention needs a CUDA GPU and there is none here"
    major, minor = torch.cuda.get_device_capability()
    if major < 8:
        return (f"PyTorch's variable-length FlashAttention runs from compute capability 8.0 (Ampere); this GPU is "
                f"{major}.{minor}")
    try:
        _varlen()
    except ImportError:
        return f"torch {torch.__version__} has no torch.nn.attention.varlen (torch 2.10 and later have it)"
    return None


def mask_needed_reason(config, seq_len: int) -> str | None:
    """Why this model's attention on sequences of `seq_len` needs transformers' mask (which neither path takes; a
    sliding window at least as long as the sequence changes nothing), or None."""
    if getattr(config, "attn_logit_softcapping", None):
        return "its attention soft-caps the logits"
    if float(getattr(config, "attention_dropout", 0.0) or 0.0) > 0:
        return "its attention has dropout"
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)  # where the config has them, they say which layers slide
    slides = "sliding_attention" in layer_types if layer_types else getattr(config, "use_sliding_window", True)
    if window and window < seq_len and slides:
        return f"its attention has a sliding window of {window} tokens"
    return None


def language_model(model):
    """The module whose attention the kernels replace: a vision-language model's decoder (transformers'
    get_decoder; its vision tower keeps SDPA over each image), else the model itself."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft's wrapper
    if getattr(getattr(base, "config", None), "vision_config", None) is not None and hasattr(base, "get_decoder"):
        return base.get_decoder()
    return model


def takes_document_boundaries(model) -> bool:
    """Whether the model's attention takes documents as boundaries (cu_seq_lens_q) rather than as the dense mask
    transformers builds from position ids that restart at each document."""
    return getattr(language_model(model).config, "_attn_implementation", None) in (FA4_NAME, VARLEN_NAME,
                                                                                   SDPA_DOCUMENTS_NAME)


def document_attention_function(kernel: str | None = None):
    """(kernel, its transformers attention function) for attention within documents: `kernel` ("varlen" or
    "sdpa-documents"), or varlen where it runs, else SDPA once per document. Also the core under Ulysses."""
    import torch

    if kernel is None:
        kernel = "varlen" if varlen_unavailable_reason() is None else "sdpa-documents"
    # document_sdpa reads the boundaries on the host: it runs outside any compiled graph
    return kernel, varlen_documents if kernel == "varlen" else torch.compiler.disable(document_sdpa)


def enable_document_attention(model, log, kernel: str | None = None) -> str:
    """Register and set the path for documents (document_attention_function); returns the kernel in force."""
    from transformers import AttentionInterface

    kernel, function = document_attention_function(kernel)
    AttentionInterface.register(KERNEL_NAMES[kernel], function)
    model.set_attn_implementation(KERNEL_NAMES[kernel])  # transformers' public setter: every submodule
    log(f"attention: {KERNEL_LABELS[kernel]} within documents, no dense mask")
    return kernel


# ----------------------------------------------------------------------------------------------------------------------
# The attention functions (transformers' signature: (batch, heads, seq, dim) in, (batch, seq, heads, dim) out)
# ----------------------------------------------------------------------------------------------------------------------
@functools.cache
def _varlen():
    """torch's varlen_attn and the keywords this torch's version takes (2.10 has is_causal; later ones window_size,
    scale and enable_gqa)."""
    from torch.nn.attention.varlen import varlen_attn

    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


def _refuse_masked(seq: int, dropout, sliding_window, softcap) -> None:
    if dropout or (sliding_window and sliding_window < seq) or softcap:  # mask_needed_reason keeps such models away
        raise RuntimeError(f"attention within documents without a mask got dropout={dropout}, "
                           f"sliding_window={sliding_window}, softcap={softcap}: run with --attention_kernel sdpa")


def varlen_documents(module, query, key, value, attention_mask, dropout=0.0, scaling=None, sliding_window=None,
                     softcap=None, **kwargs):
    """Causal attention within the documents `cu_seq_lens_q` marks, through torch's varlen_attn over the flattened
    batch; without boundaries, causal SDPA over each row."""
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    batch, heads, seq, dim = query.shape
    _refuse_masked(seq, dropout, sliding_window, softcap)
    boundaries = kwargs.get("cu_seq_lens_q")
    if boundaries is None:
        if seq != key.shape[2]:
            raise RuntimeError("attention within documents takes whole sequences (no KV cache): generate with the "
                               "exported model")
        for name in ("is_causal", "cu_seq_lens_k", "max_length_q", "max_length_k", "position_ids"):
            kwargs.pop(name, None)
        return sdpa_attention_forward(module, query, key, value, None, scaling=scaling, is_causal=True, **kwargs)
    varlen_attn, takes = _varlen()
    q, k, v = (t.transpose(1, 2).reshape(batch * seq, t.shape[1], t.shape[3]) for t in (query, key, value))
    options = {"window_size": (-1, 0)} if "window_size" in takes else {"is_causal": True}
    if k.shape[1] != heads:  # grouped-query attention
        if "enable_gqa" in takes:
            options["enable_gqa"] = True
        else:
            k, v = (t.repeat_interleave(heads // t.shape[1], dim=1) for t in (k, v))
    if scaling is not None:
        if "scale" in takes:
            options["scale"] = float(scaling)
        else:  # the kernel's own scale is 1/sqrt(dim)
            q = q * (float(scaling) * dim ** 0.5)
    cu = boundaries.to(torch.int32)
    longest = int(kwargs.get("max_length_q") or seq)
    out = varlen_attn(q, k, v, cu, cu, longest, longest, **options)
    return out.view(batch, seq, heads, out.shape[-1]), None


def document_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """SDPA causal within each document: the documents are `cu_seq_lens_q`, their offsets in the flattened rows;
    without them, causal over each whole row. Each document is one causal SDPA call on its own slice: no mask, so SDPA
    takes its flash or memory-efficient kernels, and nothing is computed across documents."""
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    _refuse_masked(query.shape[2], 0, kwargs.pop("sliding_window", None), kwargs.pop("softcap", None))
    kwargs.pop("is_causal", None)
    boundaries = kwargs.pop("cu_seq_lens_q", None)
    for name in ("cu_seq_lens_k", "max_length_q", "max_length_k", "position_ids"):
        kwargs.pop(name, None)
    if boundaries is None:
        return sdpa_attention_forward(module, query, key, value, None, dropout=dropout, scaling=scaling,
                                      is_causal=True, **kwargs)
    batch, _, seq, _ = query.shape
    flat = [t.transpose(0, 1).reshape(t.shape[1], batch * seq, t.shape[3]) for t in (query, key, value)]
    cuts = boundaries.tolist()
    outputs = []
    for start, end in zip(cuts[:-1], cuts[1:]):
        q, k, v = (t[:, start:end].unsqueeze(0) for t in flat)
        out, _ = sdpa_attention_forward(module, q, k, v, None, dropout=dropout, scaling=scaling, is_causal=True,
                                        **kwargs)
        outputs.append(out)
    out = torch.cat(outputs, dim=1)  # (1, batch x seq, heads, dim)
    return out.view(batch, seq, *out.shape[2:]), None
