"""Every place this project replaces or reaches below a library's public API, in one package.

Each module holds one library's patches and declares them as `Patch` records: what is replaced, the versions it was
tested on (checked at run time by `gate`: any other version, or the library missing, takes the library's own path and
the log says so, so a new release costs speed, never correctness), the measured gain that justifies it, and the tests
that show it behaves as the stock path does. tests/unit/patches/test_patches.py checks the records against the installed
libraries and that each named test exists; registry.py lists every record. The package imports nothing else of the
project, so every layer may use it.

    deepspeed_zero   the ZeRO-1/2 step's overflow check through the gradient norm, and its verdict on the GPU
    deepspeed_offload  ZeRO's CPU-offloaded update run beside the next step (the delayed parameter update)
    deepspeed_zero3  ZeRO-3 checkpoints of a partial optimizer offload that hold the GPU part's state too
    deepspeed_checkpoint  the universal conversion of a sequence-parallel checkpoint
    liger            the chunking of Liger's fused linear cross-entropy
    flash_attn4      FlashAttention-4's kernels as a torch custom op and a transformers attention implementation
    torch_compile    torch.compile's recompile limits and activation memory budget for the compiled layers
    bitsandbytes_cpu  4-bit layers that keep their training layout on CPUs with AVX512-BF16
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib import metadata


@dataclass(frozen=True)
class Patch:
    distribution: str  # the package whose internals are used
    oldest: str  # the first release with the private names used (and tested)
    newest: str  # the newest release the project ran them on (GPU benchmarks and CI)
    replaces: str  # what is replaced or called below the public API
    gain: str  # the measured reason, with where docs/PERFORMANCE.md gives it
    tests: tuple[str, ...]  # test functions that show it equals the stock behaviour

    @property
    def what(self) -> str:
        return self.replaces.split(":")[0]


def _key(version: str) -> tuple:
    """A sortable key for release versions such as 0.19.8, 4.0.0b36 or 2.11.0+cu130 (pre-releases sort first)."""
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
    """Whether `version` lies in [oldest, newest]; a newest given as major.minor covers its patch releases."""
    if newest.count(".") == 1:
        return _key(oldest) <= _key(version) and _key(version)[0][:2] <= _key(newest)[0][:2]
    return _key(oldest) <= _key(version) <= _key(newest)


def gate(patch: Patch, log=None) -> bool:
    """True when the installed version is one `patch` was tested with; otherwise logs that the stock path is taken."""
    version = installed(patch.distribution)
    if version is not None and within(version, patch.oldest, patch.newest):
        return True
    if log is not None:
        log(f"versions: {patch.distribution} {version or 'not installed'} is outside {patch.oldest}-{patch.newest}, "
            f"the versions the patch of {patch.what} was tested with: using the library's own path instead")
    return False


