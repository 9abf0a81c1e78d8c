"""Checkpoints that count only when complete, resume from the newest complete one, retention, and HF export.

Layout of CHECKPOINT_DIR:
    step-00000100/            DeepSpeed's files for step 100, one rng_state_rankNNNNN.pt per rank,
        manifest.json         written last, by rank 0, after every rank has written and fsynced its files
    latest                    the newest complete tag, rewritten atomically after its manifest (DeepSpeed reads it too)
    metrics.jsonl, hf/        metrics and the exported Hugging Face model
    incomplete/               checkpoints found incomplete when a run started, moved aside (kept, never read)

A checkpoint directory without a valid manifest, or whose files do not match the sizes the manifest records, is
incomplete. A run's start (rank 0, holding the run lock) moves each one into `incomplete/` with a warning naming why,
and resumes from the newest complete checkpoint, or starts from step 0, saying so, where none is left: a save cut short
never blocks a restart (a requeued job makes progress). `latest` is a hint: whatever it holds (bytes that are not
text, nothing, a directory, the name of a missing or incomplete checkpoint), the newest complete checkpoint is used,
with a warning where `latest` disagrees.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .config import REPO_ROOT
from .run_dir import CHECKPOINT_NAME, INCOMPLETE, LATEST, MANIFEST, checkpoint_name  # noqa: F401  (names of the protocol)


def _fsync_file(path: Path):
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_text(path: Path, text: str):
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def code_version() -> str:
    try:
        out = subprocess.run(["git", "-C", str(REPO_ROOT), "describe", "--always", "--dirty"], capture_output=True,
                             text=True, timeout=5)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


# --------------------------------------------------------------------------------------------------------------------
# Finding a checkpoint to resume from
# --------------------------------------------------------------------------------------------------------------------
@dataclass
class CheckpointInfo:
    path: Path
    step: int
    manifest: dict | None = None
    problem: str | None = None

    @property
    def complete(self) -> bool:
        return self.manifest is not None and self.problem is None


def inspect_checkpoint(path: Path) -> CheckpointInfo:
    m = CHECKPOINT_NAME.match(path.name)
    info = CheckpointInfo(path, int(m.group(1)) if m else -1)
    manifest_path = path / MANIFEST
    if not manifest_path.exists():
        info.problem = f"{manifest_path} is missing (the save did not finish)"
        return info
    try:
        manifest = json.loads(manifest_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        info.problem = f"{manifest_path} is not valid JSON ({e})"
        return info
    for name, size in manifest.get("files", {}).items():
        f = path / name
        if not f.exists():
            info.problem = f"{f} is missing"
            return info
        if f.stat().st_size != size:
            info.problem = f"{f} has {f.stat().st_size} bytes, the manifest recorded {size} (truncated or overwritten)"
            return info
    info.manifest = manifest
    return info


def list_checkpoints(ckpt_dir: Path) -> list[CheckpointInfo]:
    if not ckpt_dir.is_dir():
        return []
    dirs = [p for p in ckpt_dir.iterdir() if p.is_dir() and CHECKPOINT_NAME.match(p.name)]
    return sorted((inspect_checkpoint(p) for p in dirs), key=lambda c: c.step, reverse=True)


class ResumeError(Exception):
    pass


def read_latest(ckpt_dir: Path) -> tuple[str | None, str | None]:
    """The checkpoint `latest` names, or None with why it names none usable (None, None: there is no `latest`).
    Never raises: `latest` is only a hint, and the newest complete checkpoint is what a resume uses."""
    latest = ckpt_dir / LATEST
    if not latest.exists() and not latest.is_symlink():
        return None, None
    try:
        raw = latest.read_bytes()
    except IsADirectoryError:
        return None, f"{latest} is a directory, not a file naming a checkpoint"
    except OSError as e:
        return None, f"{latest} could not be read ({e.strerror or e})"
    try:
        name = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        return None, f"{latest} holds {len(raw)} bytes that are not text ({raw[:16]!r}...)"
    if not name:
        return None, f"{latest} is empty"
    if not CHECKPOINT_NAME.match(name):
        return None, f"{latest} holds {name[:60]!r}, not a checkpoint name (step-XXXXXXXX)"
    if not (ckpt_dir / name).is_dir():
        return None, f"{latest} names {name}, which does not exist"
    info = inspect_checkpoint(ckpt_dir / name)
    if not info.complete:
        return None, f"{latest} names {name}, which is incomplete ({info.problem})"
    return name, None


def find_resume_checkpoint(ckpt_dir: Path, warn) -> CheckpointInfo | None:
    """The newest complete checkpoint, warning about each newer incomplete one and about a `latest` that names
    something else; None where there is no complete one."""
    _, why = read_latest(ckpt_dir)
    if why:
        warn(f"{why}; looking for the newest complete checkpoint instead")
    for info in list_checkpoints(ckpt_dir):
        if info.complete:
            return info
        warn(f"skipping incomplete checkpoint {info.path.name}: {info.problem}")
    return None


def aside_path(ckpt_dir: Path, name: str) -> Path:
    """Where an incomplete checkpoint `name` is moved: incomplete/NAME, or incomplete/NAME.N where that is taken (the
    same step cut short again)."""
    target = ckpt_dir / INCOMPLETE / name
    n = 1
    while target.exists():
        target = ckpt_dir / INCOMPLETE / f"{name}.{n}"
        n += 1
    return target


def move_incomplete_aside(ckpt_dir: Path, warn) -> list[str]:
    """Move every incomplete checkpoint of `ckpt_dir` into ckpt_dir/incomplete/ (rank 0 only, under the run lock), with
    a warning naming each and why; returns one line per checkpoint moved. Nothing is deleted."""
    moved = []
    for info in list_checkpoints(ckpt_dir):
        if info.complete:
            continue
        target = aside_path(ckpt_dir, info.path.name)
        target.parent.mkdir(exist_ok=True)
        os.replace(info.path, target)
        line = f"{info.path.name} -> {target.relative_to(ckpt_dir)} ({info.problem})"
        warn(f"checkpoint: incomplete checkpoint moved aside: {line}")
        moved.append(line)
    if moved:
        _fsync_dir(ckpt_dir)
    return moved


def resolve_explicit(path: Path, warn) -> CheckpointInfo:
    """--resume_from_checkpoint: a step directory, or a checkpoint directory (newest complete one inside)."""
    if CHECKPOINT_NAME.match(path.name):
        info = inspect_checkpoint(path)
        if not info.complete:
            raise ResumeError(f"--resume_from_checkpoint {path}: {info.problem}")
        return info
    found = list_checkpoints(path)
    info = find_resume_checkpoint(path, warn)
    if info is None and found:
        details = "\n".join(f"  {c.path.name}: {c.problem}" for c in found)
        raise ResumeError(f"--resume_from_checkpoint {path}: none of its checkpoints is complete:\n{details}\n"
                          "name another checkpoint, or leave --resume_from_checkpoint out to resume from "
                          "--checkpoint_dir")
    if info is None:
        raise ResumeError(f"--resume_from_checkpoint {path}: no step-XXXXXXXX checkpoint inside")
    return info


def data_position_problems(manifest: dict, path: Path, data: dict) -> list:
    """What makes the checkpoint's data position (blocks of its --seq_len, in its data, by its tokenizer) mean other
    tokens in this run: one Problem per differing setting, with both values and the fix. `data`: this run's entries
    as save() records them (seq_len, tokenizer_identity, data); an entry the manifest lacks is not compared."""
    from .config import Problem

    problems = []
    fix = "or start a new run in another --checkpoint_dir"
    old, new = manifest.get("seq_len"), data.get("seq_len")
    if old is not None and new is not None and old != new:
        problems.append(Problem("--seq_len", new, f"{path} was trained with --seq_len {old}: its data position counts "
                                f"blocks of {old} tokens, which name other tokens in blocks of {new}",
                                f"resume with --seq_len {old}, {fix}"))
    old, new = manifest.get("tokenizer_identity"), data.get("tokenizer_identity")
    if old is not None and new is not None and old != new:
        was, now = manifest.get("tokenizer") or "the model's", data.get("tokenizer") or "the model's"
        problems.append(Problem("--tokenizer", data.get("tokenizer") or "(the model's)",
                                f"{path} was trained with another tokenizer ({was}, digest {old[:12]}; this run: "
                                f"{now}, digest {new[:12]}): its data position counts other tokens",
                                f"resume with the tokenizer the checkpoint was trained with, {fix}"))
    old, new = manifest.get("data"), data.get("data")
    if old is not None and new is not None and old.get("fingerprint") != new.get("fingerprint"):
        def described(d: dict) -> str:
            name = d.get("dataset") or "the embedded corpus"
            return f"{name}: {d.get('tokens', 0):,} tokens, digest {d.get('fingerprint')}"

        problems.append(Problem("--dataset", new.get("dataset") or "(the embedded corpus)",
                                f"{path} was trained on other training tokens ({described(old)}; this run: "
                                f"{described(new)}): its data position would continue at another place",
                                f"resume with the data (and --max_documents, --text_column) the checkpoint was trained "
                                f"on, {fix}"))
    return problems


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


def rng_state_file(path: Path, rank: int) -> Path:
    return path / f"rng_state_rank{rank:05d}.pt"


# ZeRO partitions the optimizer state by rank, so a checkpoint saved by another number of ranks is loaded through
# DeepSpeed's world-size-independent universal format, converted once into a sibling directory.
def universal_dir(path: Path) -> Path:
    return path.with_name(f"{path.name}-universal")


def world_size_changed(info: CheckpointInfo, world_size: int) -> bool:
    return info.manifest.get("world_size") != world_size


def needs_universal(info: CheckpointInfo, world_size: int, zero_stage: int) -> bool:
    return world_size_changed(info, world_size) and zero_stage > 0


def universal_command(info: CheckpointInfo) -> list[str]:
    return [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(info.path),
            "--output_folder", str(universal_dir(info.path))]


def convert_to_universal(info: CheckpointInfo, dist, log) -> str:
    """Convert a checkpoint saved by another number of ranks (once; rank 0) and return the tag to load."""
    target, command = universal_dir(info.path), universal_command(info)
    error = None
    if dist.is_main and not (target / "converted").exists():
        log(f"resume: {info.path.name} was saved by {info.manifest.get('world_size')} ranks, this run has "
            f"{dist.world_size}; converting it to a universal checkpoint: {' '.join(command)}")
        proc = subprocess.run(command, capture_output=True, text=True)
        if proc.returncode != 0:
            error = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit status {proc.returncode}"
        else:
            atomic_write_text(target / "converted", info.path.name)
    error = dist.broadcast_object(error)
    if error:
        raise ResumeError(f"{info.path} was saved by {info.manifest.get('world_size')} ranks and this run has "
                          f"{dist.world_size}; converting it failed ({error}). Run it by hand:\n  {' '.join(command)}\n"
                          "or resume with the original number of ranks")
    return target.name


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
    With a background_save.HostCopyWriter installed as the engine's checkpoint engine, returns once the state is in
    host memory; commit_save makes it visible after every rank's writes are done."""
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
                _fsync_file(f)
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
            _fsync_file(f)
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


# --------------------------------------------------------------------------------------------------------------------
# Export to a Hugging Face model directory
# --------------------------------------------------------------------------------------------------------------------
def write_hf_model(model, tokenizer, out_dir: Path, state_dict: dict | None = None):
    """safetensors + config (generation-ready: use_cache on) + tokenizer, for `from_pretrained`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    model.config.use_cache = True
    model.save_pretrained(out_dir, state_dict=state_dict, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)


def gathered_state_dict(model, dist) -> dict | None:
    """The full state dict of a ZeRO-3 model on rank 0 (CPU tensors), None elsewhere. Every rank takes part."""
    import deepspeed

    state, first_name = {}, {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in first_name:  # tied weights: gathered once (on every rank alike), the same tensor twice
            if dist.is_main:
                state[name] = state[first_name[id(tensor)]]
            continue
        first_name[id(tensor)] = name
        with deepspeed.zero.GatheredParameters([tensor] if hasattr(tensor, "ds_id") else [], modifier_rank=None):
            if dist.is_main:
                state[name] = tensor.detach().cpu().clone()
    return state if dist.is_main else None


def export_hf(engine, model, tokenizer, out_dir: Path, zero_stage: int, dist, log) -> Path | None:
    """Write safetensors + config + tokenizer that `AutoModelForCausalLM.from_pretrained` loads.

    ZeRO-3 parameters are partitioned: each is gathered in turn (DeepSpeed's public `GatheredParameters`, one tensor
    on the GPU at a time) into a full 16-bit state dict on rank 0, so the export is never silently empty.
    """
    if zero_stage == 3:
        state_dict = gathered_state_dict(model, dist)
    else:
        state_dict = model.state_dict() if dist.is_main else None
    if dist.is_main:
        if not state_dict:
            raise RuntimeError("export produced an empty state dict; refusing to write an empty model")
        write_hf_model(model, tokenizer, out_dir, state_dict)
        log(f"export: Hugging Face model written to {out_dir}")
    dist.barrier()
    return out_dir
