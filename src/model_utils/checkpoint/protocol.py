"""Checkpoints that count only when complete: their layout, what makes one complete, the newest complete one to resume
from, and the universal conversion for another world size (saving is save.py).

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

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from model_utils.core.problems import Problem
from model_utils.core.repo import REPO_ROOT
from model_utils.core.run_dir import CHECKPOINT_NAME, INCOMPLETE, LATEST, MANIFEST
from model_utils.patches.deepspeed_checkpoint import data_parallel_view


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


def sequence_parallel_of(info: CheckpointInfo) -> int:
    """The --sequence_parallel a checkpoint was saved with (its resolved DeepSpeed config's sequence_parallel_size)."""
    return int((info.manifest.get("ds_config") or {}).get("sequence_parallel_size", 1))


def universal_source(info: CheckpointInfo) -> Path:
    """What the conversion reads: the checkpoint, or for a sequence-parallel one the view of it that records no
    tensor parallelism (patches.deepspeed_checkpoint), written beside it while the conversion runs."""
    return info.path.with_name(f"{info.path.name}-view") if sequence_parallel_of(info) > 1 else info.path


def universal_command(info: CheckpointInfo) -> list[str]:
    return [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
            str(universal_source(info)), "--output_folder", str(universal_dir(info.path))]


def convert_to_universal(info: CheckpointInfo, dist, log) -> str:
    """Convert a checkpoint saved by another number of ranks (once; rank 0) and return the tag to load."""
    target, command = universal_dir(info.path), universal_command(info)
    error = None
    if dist.is_main and not (target / "converted").exists():
        log(f"resume: {info.path.name} was saved by {info.manifest.get('world_size')} ranks, this run has "
            f"{dist.world_size}; converting it to a universal checkpoint: {' '.join(command)}")
        source = universal_source(info)
        if source != info.path:
            data_parallel_view(info.path, source)
        try:
            proc = subprocess.run(command, capture_output=True, text=True)
        finally:
            if source != info.path:
                shutil.rmtree(source, ignore_errors=True)
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


