"""Speed levers for GPUs, each behind a switch that falls back cleanly (CPU, package missing).

`--fused_kernels auto|on|off`: Liger-Kernel's Triton kernels for Qwen3 (RoPE, RMSNorm, SwiGLU and the fused linear
cross-entropy, which never materialises the full fp32 logits). `auto` uses them with CUDA when `liger-kernel` is
installed; on CPU the model runs unchanged, so CI exercises the same training code path.
"""

from __future__ import annotations

import importlib.util

from .arguments import Problem


def liger_available() -> bool:
    return importlib.util.find_spec("liger_kernel") is not None


def fused_kernels_problem(setting: str, cuda: bool) -> Problem | None:
    if setting == "on" and not cuda:
        return Problem("--fused_kernels", setting, "the Liger kernels are Triton GPU kernels and there is no GPU here",
                       "use --fused_kernels auto (on where possible) or off")
    if setting == "on" and not liger_available():
        return Problem("--fused_kernels", setting, "liger-kernel is not installed",
                       "pip install liger-kernel (or the project's [gpu] extra), or use --fused_kernels auto/off")
    return None


def use_fused_kernels(setting: str, cuda: bool) -> bool:
    return setting != "off" and cuda and liger_available()


def apply_fused_kernels(model, setting: str, cuda: bool, log) -> bool:
    """Patch `model` in place with Liger's kernels when enabled; return whether they are in use."""
    if not use_fused_kernels(setting, cuda):
        return False
    from liger_kernel.transformers import _apply_liger_kernel_to_instance

    _apply_liger_kernel_to_instance(model=model)
    log("kernels: Liger fused RoPE, RMSNorm, SwiGLU and linear cross-entropy enabled")
    return True
