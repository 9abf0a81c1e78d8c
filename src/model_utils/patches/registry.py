"""Every patch record of the package by name, and the run header's line of which of them their installed library
versions allow. Apart from the gate (the package's __init__), so that the patch modules import the gate and this
module imports them, with no circle."""

from __future__ import annotations

from model_utils import patches
from model_utils.patches import (bitsandbytes_cpu, deepspeed_checkpoint, deepspeed_offload, deepspeed_zero,
                                 deepspeed_zero3, flash_attn4, liger, torch_compile)


def all_patches() -> dict[str, patches.Patch]:
    """Every patch record by name (module.NAME), for the tests and the docs."""
    return {f"{module.__name__.rsplit('.', 1)[1]}.{name}": value
            for module in (bitsandbytes_cpu, deepspeed_checkpoint, deepspeed_offload, deepspeed_zero, deepspeed_zero3,
                           flash_attn4, liger, torch_compile)
            for name, value in vars(module).items() if isinstance(value, patches.Patch)}


def versions_line() -> str:
    """The run header's line: the patches whose tested versions are installed (each still applies only where its
    setting asks for it) and those that take the library's own path, with the version found."""
    open_, stock = [], []
    for name, patch in all_patches().items():
        version = patches.installed(patch.distribution)  # read at call time: the tests stand in for it
        if version is not None and patches.within(version, patch.oldest, patch.newest):
            open_.append(name)
        else:
            found = f"{patch.distribution} {version}" if version else f"{patch.distribution} not installed"
            stock.append(f"{name} ({found}, tested {patch.oldest}-{patch.newest})")
    return (f"patches: tested versions installed, used where their setting applies: {', '.join(open_) or 'none'}; "
            f"the library's own path: {', '.join(stock) or 'none'}")
