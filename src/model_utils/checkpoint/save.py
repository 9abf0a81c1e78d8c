"""Saving a checkpoint: every rank writes and fsyncs its files (DeepSpeed's, its RNG state), then rank 0 writes the
manifest and `latest` (protocol.py's complete-only rule); a failed write on any rank fails the save on every rank,
with the cause and its fix; retention removes the checkpoints past --keep_last_checkpoints.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from model_utils.checkpoint.protocol import (atomic_write_text, code_version, list_checkpoints, rng_state_file,
                                             universal_dir)
from model_utils.core.run_dir import LATEST, MANIFEST, checkpoint_name


# --------------------------------------------------------------------------------------------------------------------
# Saving
# --------------------------------------------------------------------------------------------------------------------
class SaveFailed(Exception):
    pass


# torch.save reports the OS's error as text (RuntimeError "[enforce fail at inline_container.cc:747] . open file failed
# with strerror: Read-only file system"), DeepSpeed's and our own writes as OSError with an errno: both are read.
WRITE_ERRORS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOENT)


# A short write without an errno: torch's zip writer on a full disk ("unexpected pos 14016 vs 13910").
SHORT_WRITE = ("unexpected pos", "file write failed")


FULL_BELOW_BYTES = 64 * 2**20  # free space under which a short write is taken for a full disk


def _errno_of(error: BaseException) -> int | None:
    if isinstance(error, OSError) and error.errno:
        return error.errno
    text = str(error)
    for code in WRITE_ERRORS:
        if os.strerror(code) in text:
            return code
    if "Parent directory" in text and "does not exist" in text:
        return errno.ENOENT
    return None


def _existing_ancestor(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _bytes_in(path: Path) -> int:
    try:
        return sum(f.stat().st_size for f in path.iterdir() if f.is_file())
    except OSError:
        return 0


def write_failure(error: BaseException, path: Path) -> tuple[str, str]:
    """What made writing `path` (a file of checkpoint directory STEP_DIR in CHECKPOINT_DIR) fail, and the fix: no
    space (with the filesystem's free bytes, those written so far and what a checkpoint takes), permission, a vanished
    directory, a read-only filesystem; else the error as reported."""
    path = Path(path)
    step_dir, ckpt_dir = path.parent, path.parent.parent
    code = _errno_of(error)
    usage = shutil.disk_usage(_existing_ancestor(step_dir))
    previous = next((c for c in list_checkpoints(ckpt_dir) if c.complete), None)
    checkpoint_bytes = sum(previous.manifest["files"].values()) if previous else 0
    if code is None and any(words in str(error) for words in SHORT_WRITE):
        if usage.free < max(FULL_BELOW_BYTES, checkpoint_bytes - _bytes_in(step_dir)):
            code = errno.ENOSPC
    if code in (errno.ENOSPC, errno.EDQUOT):
        takes = (f"; a checkpoint takes about {checkpoint_bytes:,} bytes (the size of {previous.path.name})"
                 if previous else "")
        what = "no space left" if code == errno.ENOSPC else "the disk quota is exhausted"
        return (f"{what} on the filesystem of {ckpt_dir}: {usage.free:,} bytes free of {usage.total:,}; "
                f"{_bytes_in(step_dir):,} bytes of {step_dir.name} written so far{takes}; writing {path.name}: "
                f"{error}",
                f"free space on the filesystem of {ckpt_dir} (or keep fewer checkpoints: --keep_last_checkpoints), or "
                "point --checkpoint_dir at a larger filesystem")
    if code == errno.EROFS:
        return (f"the filesystem of {ckpt_dir} is read-only (writing {path}: {error})",
                "remount it read-write, or point --checkpoint_dir at a writable filesystem")
    if code in (errno.EACCES, errno.EPERM):
        return (f"permission denied writing {path} (user id {os.getuid()}: {error})",
                f"make {step_dir} writable for this user (an immutable attribute, lsattr, stops root too), or point "
                "--checkpoint_dir elsewhere")
    if code == errno.ENOENT:
        return (f"{step_dir} vanished while it was being written (deleted, or its filesystem unmounted): {error}",
                f"keep other jobs and cleanups away from {ckpt_dir} while a run writes there, and check that it stays "
                "mounted")
    return f"writing {path} failed: {error}", f"fix what the error names in {ckpt_dir}"


# The cause and fix a rank reports when the write that failed was another rank's (that rank's message names it).
ANOTHER_RANKS_WRITE = ("a write failed on another rank", "see the message of the rank whose write failed")


def save_failed(pending_name: str, cause: str, fix: str) -> SaveFailed:
    return SaveFailed(f"checkpoint {pending_name} could not be written ({cause}); the previous complete checkpoint "
                      f"stays `latest`. Fix: {fix}; then run again to resume from it")


@dataclass
class SaveContext:
    ckpt_dir: Path
    keep_last: int
    manifest_extra: dict = field(default_factory=dict)
    save_options: dict = field(default_factory=dict)  # engine.save_checkpoint's (LoRA: exclude_frozen_parameters)


@dataclass
class PendingSave:
    """A checkpoint whose files are written (or being written) on every rank, not yet visible."""
    ctx: SaveContext
    path: Path
    step: int
    manifest_fields: dict
    started: float  # time.perf_counter() when the save began


def save_checkpoint(engine, ctx: SaveContext, step: int, client_state: dict, rng: dict, dist, log,
                    writer=None) -> PendingSave:
    """Save on every rank. Without `writer`, returns once the checkpoint is complete and visible (manifest, `latest`).
    With a checkpoint.background.HostCopyWriter installed as the engine's checkpoint engine, returns once the state is
    in host memory; commit_save makes it visible after every rank's writes are done."""
    tag = checkpoint_name(step)
    path = ctx.ckpt_dir / tag
    pending = PendingSave(ctx, path, step, {k: v for k, v in client_state.items()
                                            if k in ("tokens_seen", "data_position")}, time.perf_counter())
    if dist.is_main and path.exists():
        shutil.rmtree(path)  # a leftover from a crash at this same step
    dist.barrier()
    target, failure = path / "(DeepSpeed's files)", None
    try:
        engine.save_checkpoint(str(ctx.ckpt_dir), tag=tag, client_state=client_state, save_latest=False,
                               **ctx.save_options)
        if writer is not None:
            writer.save_file(rng, rng_state_file(path, dist.rank))
            return pending
        target = rng_state_file(path, dist.rank)
        torch.save(rng, target)
        for f in path.iterdir():
            if f.is_file():
                target = f
                fsync_file(f)
    except (OSError, RuntimeError) as e:  # disk full, permissions, a read-only or vanished directory: named
        if writer is not None:
            raise save_failed(tag, *write_failure(e, target)) from e
        failure = write_failure(e, target)
    agree_on_failure(failure, tag, dist)  # every rank's shards are on disk, or all ranks stop together
    commit_everywhere(pending, dist, log)
    log(f"checkpoint: saved {path} in {time.perf_counter() - pending.started:.1f}s")
    return pending


def agree_on_failure(failure: tuple[str, str] | None, tag: str, dist) -> None:
    """Every rank calls this at the same point with its own write_failure (None: its writes succeeded); all raise
    SaveFailed if any failed, the failing rank with its cause."""
    failed = torch.tensor([1.0 if failure else 0.0], device=dist.device)
    dist.all_reduce(failed, torch.distributed.ReduceOp.MAX)
    if failed.item():
        raise save_failed(tag, *(failure or ANOTHER_RANKS_WRITE))


def commit_everywhere(pending: PendingSave, dist, log):
    """commit_save, called by every rank at the same point: a manifest or `latest` that rank 0 cannot write (a disk
    that filled meanwhile) stops every rank with its cause."""
    failure = None
    try:
        commit_save(pending, dist, log)
    except OSError as e:
        failure = write_failure(e, pending.path / MANIFEST)
    agree_on_failure(failure, pending.path.name, dist)


def commit_save(pending: PendingSave, dist, log):
    """Make a checkpoint whose files every rank has written and fsynced visible: rank 0 writes its manifest (the
    commit point), then `latest`, then applies retention."""
    if not dist.is_main:
        return
    path = pending.path
    for f in path.iterdir():  # rank 0's own files not written through the engine (DeepSpeed's recovery script)
        if f.is_file():
            fsync_file(f)
    files = {f.name: f.stat().st_size for f in sorted(path.iterdir()) if f.is_file() and f.name != MANIFEST}
    manifest = dict(step=pending.step, world_size=dist.world_size, files=files, code_version=code_version(),
                    saved_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"), **pending.ctx.manifest_extra,
                    **pending.manifest_fields)
    atomic_write_text(path / MANIFEST, json.dumps(manifest, indent=1, default=str))
    atomic_write_text(pending.ctx.ckpt_dir / LATEST, path.name)
    apply_retention(pending.ctx.ckpt_dir, pending.ctx.keep_last, log)


def apply_retention(ckpt_dir: Path, keep_last: int, log):
    """Keep the newest `keep_last` complete checkpoints; remove older ones and incomplete leftovers older than them."""
    if keep_last <= 0:
        return
    found = list_checkpoints(ckpt_dir)
    complete = [c for c in found if c.complete]
    if not complete:
        return
    keep = {c.path for c in complete[:keep_last]}
    oldest_kept = min(c.step for c in complete[:keep_last])
    for c in found:
        if c.path not in keep and c.step < oldest_kept:
            shutil.rmtree(c.path, ignore_errors=True)
            shutil.rmtree(universal_dir(c.path), ignore_errors=True)
            log(f"checkpoint: removed {c.path.name} (keeping the last {keep_last})")


def fsync_file(path: Path):
    with open(path, "rb") as f:
        os.fsync(f.fileno())
