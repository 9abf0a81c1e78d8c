"""The speed options (`SpeedConfig`, config/settings.py): which of them apply to this model on this machine, and
applying them. Each falls back cleanly (no GPU, ZeRO-3, a package or tested version missing), so CPU runs and CI take
the same code path; what reaches below a library's public API lives in `patches/`, gated on the versions it was tested
with.

Under ZeRO-3 the LM head weight is partitioned and Liger's fused loss reads it outside `lm_head.forward`; it is
registered as an external parameter of the top-level module so ZeRO gathers it for the whole forward/backward.

Attention: FlashAttention-4 where it runs; otherwise, for documents and packed examples on a GPU, PyTorch's
variable-length FlashAttention (from Ampere on) or SDPA once per document (models.document_attention), no dense mask;
SDPA for the rest.

Under ZeRO-3 without offload, each decoder layer is a ZeRO-3 leaf module (DeepSpeed's public
`set_z3_leaf_modules`): its parameters are gathered and released together by hooks on the layer alone, which run
eagerly around the layer's compiled `forward`, so the graph sees whole weights and no hook inside it.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import inspect

from model_utils.config.settings import SpeedConfig
from model_utils.core.problems import Problem
from model_utils.models.build import head_dim
from model_utils.models.document_attention import (enable_document_attention, language_model, mask_needed_reason,
                                                   varlen_unavailable_reason)
from model_utils.patches import deepspeed_zero, flash_attn4, liger, torch_compile


def liger_available() -> bool:
    return importlib.util.find_spec("liger_kernel") is not None


def fused_kernels_problem(speed: SpeedConfig, cuda: bool) -> Problem | None:
    """An option asked for by name that cannot run here (`auto` never is a problem: it falls back)."""
    if speed.fused_kernels == "on" and not cuda:
        return Problem("--fused_kernels", "on", "the Liger kernels are Triton GPU kernels and there is no GPU here",
                       "use --fused_kernels auto (on where possible) or off")
    if speed.fused_kernels == "on" and not liger_available():
        return Problem("--fused_kernels", "on", "liger-kernel is not installed",
                       "pip install liger-kernel (or the project's [gpu] extra), or use --fused_kernels auto/off")
    if speed.attention_kernel == "fa4" and cuda:
        reason = flash_attn4.fa4_unavailable_reason()
        if reason:
            return Problem("--attention_kernel", "fa4", reason, "pip install flash-attn-4 on a Hopper/Blackwell GPU, "
                           "or use --attention_kernel auto (SDPA where FA4 cannot run)")
    if speed.attention_kernel == "varlen" and cuda:
        reason = varlen_unavailable_reason()
        if reason:
            return Problem("--attention_kernel", "varlen", reason, "use --attention_kernel auto (SDPA once per "
                           "document where PyTorch's varlen cannot run)")
    return None


def use_fused_kernels(setting: str, cuda: bool) -> bool:
    return setting != "off" and cuda and liger_available()


def _is_zero3(model) -> bool:
    return any(hasattr(p, "ds_id") for p in model.parameters())


def use_compile(cuda: bool, zero3_eager: bool, speed: SpeedConfig) -> bool:
    """Compiled decoder layers: with CUDA, unless ZeRO-3 keeps them eager (`zero3_keeps_eager_layers`)."""
    return speed.compile in ("layers", "auto") and cuda and not zero3_eager


def liger_kernels_in_force(which: str, compiled: bool) -> str:
    """--liger_kernels as it applies: auto is the fused linear cross-entropy alone beside compiled layers (Inductor fuses
    the norms, RoPE and SwiGLU inside them), all four beside eager ones."""
    return ("flce" if compiled else "all") if which == "auto" else which


def zero3_keeps_eager_layers(zero_stage: int, offloaded: bool, lora: bool) -> bool:
    """ZeRO-3 runs eager layers, hooks on every submodule, where it offloads the parameters or the optimizer (a whole
    layer's gather from host memory would not overlap the layer's compute as the per-submodule ones do; the offload
    paths, the delayed update among them, are measured with eager layers) or where LoRA wraps the layers (peft's
    frozen weights are found released in the compiled layers' backward)."""
    return zero_stage == 3 and (offloaded or lora)


def use_fa4(cuda: bool, model, speed: SpeedConfig) -> bool:
    if speed.attention_kernel == "sdpa" or not cuda or getattr(model.config, "_attn_implementation", "sdpa") != "sdpa":
        return False
    dim = head_dim(model.config)
    return dim % 8 == 0 and 8 <= dim <= 256 and flash_attn4.fa4_unavailable_reason() is None


def apply_speed_options(model, speed: SpeedConfig, cuda: bool, log, warn=None, documents: bool = False,
                       fused: bool | None = None, compiled: bool | None = None, seq_len: int | None = None,
                       loss_tokens: int | None = None) -> dict:
    """Patch `model` in place with the options that apply; return what is in force (recorded in the checkpoint's
    manifest and summary.json). `log` reports what was applied (rank 0 is enough: every rank applies the same, except
    that a rank whose FlashAttention-4 probe fails keeps SDPA); `warn` (default `log`) reports that failure, from the
    rank it happened on. `documents`: the run attends within documents or examples (--document_mask, packed
    examples), so FlashAttention-4's probe covers its variable-length kernels, and without FlashAttention-4 the
    documents go to models.document_attention (on sequences of `seq_len`). `fused`: the run's plan's decision on the
    fused loss (planning.plan.fused_loss, which its memory estimate assumed); None decides here, as the plan does.
    `compiled`: the plan's decision on the compiled layers (plan.compiled_layers); None decides here, as the plan does
    for parameters on the GPUs. `loss_tokens`: the tokens one forward's loss covers on a GPU (the micro-batch times its
    share of each sequence), which bound the fused loss's chunks (liger.chunk_budget_in_force)."""
    warn = warn or log
    zero3 = _is_zero3(model)
    # a vision-language model: the kernels and compiled layers are its language model's (the tower keeps SDPA), and
    # Liger's fused loss alone (its RoPE and norms have broken Qwen2.5-VL: Liger-Kernel#515, #827)
    decoder = language_model(model)
    if decoder is not model and speed.liger_kernels == "auto":
        speed = dataclasses.replace(speed, liger_kernels="flce")
    if compiled is None:
        compiled = use_compile(cuda, False, speed)
    applied = {"fused_kernels": "off", "flce_chunk_budget": None, "compile": "layers" if compiled else "off",
               "attention_kernel": "sdpa", "sdpa_backend": "auto"}
    if fused is None:
        fused = use_fused_kernels(speed.fused_kernels, cuda)
    if fused:
        applied["fused_kernels"] = _apply_liger(model, liger_kernels_in_force(speed.liger_kernels, compiled), log)
        if applied["fused_kernels"] != "off":
            widths = decoder.config.hidden_size, decoder.config.vocab_size
            budget = liger.chunk_budget_in_force(speed.flce_chunk_budget, loss_tokens, *widths)
            if budget < speed.flce_chunk_budget:
                logits = liger.logits_chunk_bytes(budget, loss_tokens, *widths) / 1024**3
                log(f"kernels: the fused loss's chunk budget lowered from {speed.flce_chunk_budget} (--flce_chunk_budget) "
                    f"to {budget} for {loss_tokens:,} tokens a micro-batch: its transient logits take {logits:.1f} GiB")
            if liger.set_flce_chunk_budget(budget, log):
                applied["flce_chunk_budget"] = budget
            if zero3:
                register_lm_head_for_zero3(model, log)
    elif speed.fused_kernels == "auto" and cuda:
        log("kernels: liger-kernel is not installed, so the loss materialises full fp32 logits (slower, more memory); "
            "`pip install .[gpu]` adds Liger's kernels")
    if compiled:
        compiled = _compile_layers(model, speed.activation_budget, log, zero3)
        applied["compile"] = "layers" if compiled else "off"
    if cuda and speed.sdpa_backend != "auto" and getattr(decoder.config, "_attn_implementation", "sdpa") == "sdpa":
        _sdpa_wrap(model, speed.sdpa_backend, log)  # also the fall-back path of FlashAttention-4
        applied["sdpa_backend"] = speed.sdpa_backend
    if use_fa4(cuda, decoder, speed):
        failure = flash_attn4.fa4_probe_failure(decoder, documents) if speed.attention_kernel == "auto" else None
        if failure:
            warn(f"attention: FlashAttention-4 failed its setup probe ({failure}); using SDPA (--attention_kernel sdpa "
                 "skips the probe)")
        else:
            flash_attn4.enable_fa4(decoder, log)
            applied["attention_kernel"] = "fa4"
    elif (speed.attention_kernel == "auto" and cuda and getattr(decoder.config, "_attn_implementation", "sdpa") == "sdpa"
          and (reason := flash_attn4.fa4_unavailable_reason())):
        log(f"attention: SDPA ({reason}; on Hopper/Blackwell `pip install .[fa4]` adds FlashAttention-4)")
    if documents and applied["attention_kernel"] == "sdpa" and use_document_attention(cuda, decoder, speed, seq_len,
                                                                                      log):
        applied["attention_kernel"] = enable_document_attention(decoder, log, "varlen" if speed.attention_kernel ==
                                                                "varlen" else None)
    return applied


def use_document_attention(cuda: bool, model, speed: SpeedConfig, seq_len: int | None, log) -> bool:
    """Documents' boundaries instead of transformers' dense mask where FlashAttention-4 is not in force: on a GPU, for
    the SDPA model, unless its attention needs the mask (the log says why)."""
    if speed.attention_kernel not in ("auto", "varlen") or not cuda:
        return False
    if getattr(model.config, "_attn_implementation", "sdpa") != "sdpa":
        return False
    reason = mask_needed_reason(model.config, seq_len or 0)
    if reason:
        log(f"attention: transformers masks the documents for SDPA ({reason}, which the variable-length paths do "
            "not take)")
    return reason is None


def streamline_zero_step(engine, speed: SpeedConfig, log) -> dict:
    """The ZeRO-1/2 step's overflow check (--overflow_check): what is in force, for the record."""
    return {"overflow_check": deepspeed_zero.streamline_zero_step(engine, speed.overflow_check, log)}


def _decoder_layers(model):
    decoder = language_model(model)
    if decoder is not model:  # a vision-language model's language model
        return getattr(decoder, "layers", None)
    base = getattr(model, getattr(model, "base_model_prefix", "model"), model)
    return getattr(base, "layers", None)


def _compile_layers(model, budget: float, log, zero3: bool = False) -> bool:
    import torch

    layers = _decoder_layers(model)
    if layers is None or not hasattr(torch, "compile"):
        log("compile: no decoder layers found; running eagerly")
        return False
    budget_set = torch_compile.configure(len(layers), budget, log) and budget < 1.0
    compiled_class = compiled_layer_class(type(layers[0]), torch.compile)
    for layer in layers:
        layer.__class__ = compiled_class
    if zero3:
        # ZeRO-3 gathers a leaf module's parameters at once in the hooks it registers on that module only (at
        # deepspeed.initialize, after this); the hooks stay outside the graph, which compiles the layer's forward.
        from deepspeed.utils import set_z3_leaf_modules

        set_z3_leaf_modules(model, [compiled_class])
    log(f"compile: torch.compile on each of the {len(layers)} decoder layers"
        + (f" (activation memory budget {budget})" if budget_set else "")
        + ("; ZeRO-3 gathers each layer's parameters at once (leaf modules), outside the graph" if zero3 else "")
        + "; the first step compiles them (a minute or more at 7B), a cost paid once: the run summary's means leave "
          "that first interval out")
    return True


def compiled_layer_class(layer_class: type, compile_function) -> type:
    """A subclass of the decoder layer class whose forward is the class's forward compiled: one compiled function with
    the layer as its argument, a graph shared by all layers. Activation checkpointing (--gradient_checkpointing) stays
    outside the graph: transformers wraps the forward of every subclass of a checkpointed layer class (5.25 on; its
    __call__ before), only the outermost wrapper recomputes, and the compiled one inside runs the layer itself. Compiling
    the checkpointed forward instead puts the recomputation inside the graph, where torch.compile breaks the graph at
    it and runs the whole layer eagerly."""
    compiled_forward = compile_function(layer_class.forward)

    def forward(self, *args, **kwargs):
        return compiled_forward(self, *args, **kwargs)

    return type(layer_class.__name__, (layer_class,), {"forward": forward, "__module__": layer_class.__module__,
                                                       "__qualname__": layer_class.__qualname__})


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


def _apply_liger(model, which: str, log) -> str:
    """Liger's kernels through its public entry point for the model type (apply_liger_kernel_to_<type>): all four, or
    the fused linear cross-entropy alone. Returns what was applied ('all', 'flce', or 'off' for a model type Liger has
    no entry point for)."""
    from liger_kernel.transformers import monkey_patch

    model_type = getattr(model.config, "model_type", "")
    entry_point = getattr(monkey_patch, f"apply_liger_kernel_to_{model_type}", None)
    if entry_point is None:
        log(f"kernels: Liger has no entry point for {model_type!r}; its kernels are not applied")
        return "off"
    if which == "all":
        entry_point(model=model)
        log("kernels: Liger fused RoPE, RMSNorm, SwiGLU and linear cross-entropy enabled")
    else:
        entry_point(rope=False, rms_norm=False, swiglu=False, cross_entropy=False, fused_linear_cross_entropy=True,
                    model=model)
        log("kernels: Liger fused linear cross-entropy enabled (norms, RoPE, SwiGLU left to torch.compile)")
    return which


def register_lm_head_for_zero3(model, log):
    """Under ZeRO-3 with Liger's fused loss: the LM head's weight gathered for the whole forward and backward (Liger
    reads it outside lm_head.forward). A model built whole (a 4-bit base) is registered once initialize has
    partitioned it."""
    head = getattr(model, "lm_head", None)
    if head is None or not hasattr(head.weight, "ds_id"):
        return
    from deepspeed.runtime.zero import register_external_parameter

    register_external_parameter(model, head.weight)
    log("kernels: ZeRO-3 gathers the LM head weight for Liger's fused loss (external parameter of the model)")
