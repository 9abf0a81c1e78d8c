"""DeepSpeed's op build locks: which `lock` files under torch's extensions folder would make a run wait forever.

DeepSpeed builds its ops (CPU Adam for an offloaded optimizer, the CPU ranks' shared-memory collectives) on first use
with torch's JIT builder, which takes `<build directory>/<op>/lock` while it compiles. How torch takes it decides what
a file left there means:

- torch >= 2.14 holds an OS advisory lock on the file (the `filelock` package: flock on Linux) and leaves the file in
  place after every build. The kernel releases the lock when its holder dies, so a file nobody holds is harmless at
  any age, and a held one is a build in progress that the run waits for, as it should.
- torch <= 2.13 uses `FileBaton`: the file's existence is the lock, removed when the build ends, and every process
  waits while it exists. Two kinds of file make it wait forever:
  - one left by a torch >= 2.14 of another environment sharing the build directory (same Python and CUDA version):
    nobody holds it and the op's built module is at least as new, so the build it guarded finished. The run removes
    it (remove_leftover_locks), as the build that left it would have with FileBaton.
  - one left by a killed FileBaton build: no build runs for longer than STALE_BUILD_LOCK_S, so an older file that is
    not such a leftover is a problem for the user, named with the fix.

Only the build directory of the running torch is looked at: other Python or CUDA builds of torch keep theirs apart.
"""

from __future__ import annotations

import errno
import fcntl
import os
import sys
import time
from pathlib import Path

from model_utils.core.problems import Problem

STALE_BUILD_LOCK_S = 15 * 60
# The first torch release whose JIT builder locks with filelock instead of FileBaton.
OS_LOCK_TORCH = (2, 14)


def torch_locks_with_os_lock(torch_version: str) -> bool:
    """Whether this torch release's JIT builder holds an OS lock (filelock) rather than a FileBaton file."""
    release = torch_version.split("+")[0].split(".")
    return tuple(int(part) for part in release[:2] if part.isdigit()) >= OS_LOCK_TORCH


def build_directory() -> Path:
    """The folder torch's JIT builder puts each op's build folder in, as `torch.utils.cpp_extension` lays it out:
    TORCH_EXTENSIONS_DIR itself when set, else `<default root>/py<major><minor><abiflags>_<cpu|cuNNN|rocmNNN>`."""
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    if os.environ.get("TORCH_EXTENSIONS_DIR") is not None:
        return Path(os.environ["TORCH_EXTENSIONS_DIR"])
    if torch.version.hip is not None:
        accelerator = f"rocm{torch.version.hip.replace('.', '')}"
    elif torch.version.cuda is not None:
        accelerator = f"cu{torch.version.cuda.replace('.', '')}"
    else:
        accelerator = "cpu"
    python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return Path(get_default_build_root()) / f"{python}_{accelerator}"


def is_held(lock: Path) -> bool:
    """Whether a process holds an OS lock on `lock` now (a non-blocking attempt fails); the attempt is released at
    once. A file that cannot be opened is taken as not held."""
    try:
        fd = os.open(lock, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return True
        raise
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


def _built_after(lock: Path) -> bool:
    """Whether the op's folder holds a built module (.so) at least as new as `lock`: the build the lock guarded ended,
    so a FileBaton build would have removed the file."""
    built = [module.stat().st_mtime for module in lock.parent.glob("*.so")]
    return bool(built) and max(built) >= lock.stat().st_mtime


def _running_torch(torch_version: str | None) -> str:
    if torch_version is not None:
        return torch_version
    import torch

    return torch.__version__


HELD, LEFTOVER, FREE = "held", "leftover", "free"


def _filebaton_locks(torch_version: str) -> list[tuple[Path, str, float]]:
    """Each lock file of the running torch's build directory that a FileBaton torch would wait for, with its state
    (HELD by an OS-lock torch's build, a LEFTOVER of a finished one, else FREE) and its mtime; none for an OS-lock
    torch, which waits only for a held lock (a build in progress)."""
    if torch_locks_with_os_lock(torch_version):
        return []
    found = []
    for lock in sorted(build_directory().glob("*/lock")):  # <op>/lock
        try:
            state = HELD if is_held(lock) else LEFTOVER if _built_after(lock) else FREE
            found.append((lock, state, lock.stat().st_mtime))
        except FileNotFoundError:  # a build finished meanwhile
            continue
    return found


def leftover_locks(torch_version: str | None = None) -> list[Path]:
    """Lock files a FileBaton torch would wait for forever although no build holds them: files left by an OS-lock
    torch of another environment after a finished build. None with an OS-lock torch (it ignores such files)."""
    return [lock for lock, state, _ in _filebaton_locks(_running_torch(torch_version)) if state == LEFTOVER]


def remove_leftover_locks(log, torch_version: str | None = None) -> None:
    """Remove leftover_locks before DeepSpeed builds or loads an op, saying which; another rank of this node may have
    removed one already."""
    for lock in leftover_locks(torch_version):
        try:
            lock.unlink()
        except FileNotFoundError:
            continue
        log(f"op builds: removed {lock}, left by a torch that keeps its lock files after a build (the {lock.parent.name} "
            "build it guarded finished); this torch would wait for it forever")


def stale_build_lock_problems(now: float | None = None, torch_version: str | None = None) -> list[Problem]:
    """The op build locks in the running torch's build directory that would make the run wait forever: with
    FileBaton (torch <= 2.13), a free file older than STALE_BUILD_LOCK_S (a killed build), or a file an OS-lock torch
    holds (it keeps the file after its build); leftovers are not problems, the run removes them. With an OS lock
    (torch >= 2.14), none (a free file is no obstacle, a held one is a build in progress)."""
    torch_version = _running_torch(torch_version)
    root = build_directory()
    now = time.time() if now is None else now
    problems = []
    for lock, state, mtime in _filebaton_locks(torch_version):
        op, age = lock.parent.name, now - mtime
        if state == HELD:
            problems.append(Problem(
                "TORCH_EXTENSIONS_DIR", str(root),
                f"{lock} is held by a build of the {op} op by a torch that keeps its lock files (>= 2.14, another "
                f"environment): torch {torch_version} waits while the file exists, which would be forever",
                "run again once that build has finished (the file it leaves is then removed at the start), or give "
                "this environment its own TORCH_EXTENSIONS_DIR"))
        elif state == FREE and age >= STALE_BUILD_LOCK_S:
            problems.append(Problem(
                "TORCH_EXTENSIONS_DIR", str(root),
                f"{lock} is {age / 60:.0f} minutes old: a build of the {op} op was stopped before it finished, and "
                f"every process that needs {op} would wait for this lock forever (torch {torch_version} waits while "
                "the file exists)",
                f"delete it (rm {lock}) unless a build of {op} is running now"))
    return problems
