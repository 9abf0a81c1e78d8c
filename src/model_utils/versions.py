"""Where this project reaches into a library's private API, and the versions it was tested with.

Each entry names the distribution, the oldest version where the private names exist, and the newest version the
project ran them on (GPU benchmarks and CI). Outside that range the caller takes the library's public path and logs
why (`gate`), so a newer or older release costs speed, never correctness.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import metadata


@dataclass(frozen=True)
class PrivateUse:
    distribution: str
    oldest: str  # the first release with the private names used
    newest: str  # the newest release this project ran them on
    what: str  # what is used, for the log line


# fast.py's ZeRO-1/2 step: get_norm_dtype (first in 0.19.6), check_overflow, scaled_global_norm,
# stage_1_and_2.is_invalid_grad_norm, get_grad_norm_direct, the engine's skipped_steps/_step_applied/_global_grad_norm.
DEEPSPEED_ZERO_STEP = PrivateUse("deepspeed", "0.19.6", "0.19.8", "DeepSpeed's ZeRO-1/2 step internals")
# fast.py: Liger's _apply_liger_kernel_to_instance and the default of its fused linear cross-entropy's chunk_mem_const.
LIGER_INTERNALS = PrivateUse("liger-kernel", "0.8.5", "0.8.5", "liger-kernel's instance patching and loss chunking")
# fast.py: FlashAttention-4's _flash_attn_fwd/_flash_attn_bwd (the pre-release's kernels, below its autograd wrapper).
FA4_INTERNALS = PrivateUse("flash-attn-4", "4.0.0b36", "4.0.0b36", "FlashAttention-4's forward and backward kernels")


def _key(version: str) -> tuple:
    """A sortable key for release versions such as 0.19.8, 4.0.0b36 or 2.11.0+cu130 (pre-releases sort first)."""
    import re

    release, _, _local = version.partition("+")
    match = re.match(r"^(\d+(?:\.\d+)*)(?:(a|b|rc)(\d+))?", release)
    if not match:
        return ((0,), 0, 0)
    numbers = tuple(int(x) for x in match.group(1).split("."))
    numbers += (0,) * (3 - len(numbers))
    stage = {"a": 0, "b": 1, "rc": 2}.get(match.group(2) or "", 3)
    return numbers, stage, int(match.group(3) or 0)


def installed(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def within(version: str, oldest: str, newest: str) -> bool:
    return _key(oldest) <= _key(version) <= _key(newest)


def gate(use: PrivateUse, log=None) -> bool:
    """True when the installed version is one `use` was tested with; otherwise logs that the public path is taken."""
    version = installed(use.distribution)
    if version is not None and within(version, use.oldest, use.newest):
        return True
    if log is not None:
        log(f"versions: {use.distribution} {version or 'not installed'} is outside {use.oldest}-{use.newest}, the "
            f"versions {use.what} were tested with: using its public path instead")
    return False
