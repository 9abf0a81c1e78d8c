"""Faults at exact points of a save or an evaluation (injected by tests/distributed/fault_injection.py, not timed by sleeps):
each run resumes from a complete checkpoint and continues with losses bitwise equal to an uninterrupted run."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import preloaded
from conftest import REPO, TrainerRun, assert_ok, rank_environment, rendezvous_port, run_trainer
from inputs import mounted_tmpfs
from test_training import RESUME_ARGS, _assert_continues_exactly, baseline  # noqa: F401 (the fixture)

from model_utils.checkpoint.protocol import inspect_checkpoint

INJECT = Path(__file__).with_name("fault_injection.py")
EVERY_STEP = [*RESUME_ARGS, "--checkpoint_freq", "1", "--keep_last_checkpoints", "0"]


def run_with_fault(ckpt: Path, args: list[str], fault: str, timeout: float = 300,
                   log_dir: Path | None = None) -> TrainerRun:
    """Both ranks run the trainer through the injector; when one dies, the other is killed too (as srun does). Their
    logs go to `log_dir` (default: beside `ckpt`)."""
    port, procs, logs = rendezvous_port(), [], []
    for rank in range(2):
        env = rank_environment(rank, 2, port, {"FAULT": fault})
        logs.append((log_dir or ckpt.parent) / f"{ckpt.name}-fault-rank{rank}.log")
        procs.append(preloaded.Popen([sys.executable, str(INJECT), "--checkpoint_dir", str(ckpt), *args], cwd=REPO,
                                     env=env, stdout=open(logs[-1], "w"), stderr=subprocess.STDOUT))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and all(p.poll() is None for p in procs):
        time.sleep(0.05)
    if any(p.poll() not in (None, 0, 75) for p in procs):  # a rank died: the step is over for all
        time.sleep(1)
        for p in procs:
            if p.poll() is None:
                p.kill()
    codes = [p.wait(timeout=max(1, deadline - time.monotonic())) for p in procs]
    return TrainerRun(codes, [log.read_text() for log in logs], ckpt)


@pytest.mark.parametrize("point, writes", [("kill-before-manifest", []),
                                           ("kill-before-manifest", ["--no-background_checkpoint"]),
                                           ("kill-in-save", [])],
                         ids=["in-the-background", "synchronous", "after-its-first-file"])
def test_kill_9_of_one_rank_before_the_manifest(baseline, tmp_path, point, writes):
    """Rank 1 dies once it has written and fsynced its files of step 7: in the background (while training went on)
    or in a synchronous save; or once it has written the first of them, the rest never written (the other rank is then
    killed too, as srun does). Step 7 never gets a manifest; the resumed run skips it and is exact from step 6."""
    ckpt = tmp_path / "ckpt"
    first = run_with_fault(ckpt, [*EVERY_STEP, *writes], f"{point}:1:7")
    assert first.returncodes[1] == -9
    assert (ckpt / "step-00000007").is_dir() and not (ckpt / "step-00000007" / "manifest.json").exists()
    # rank 1's last file, its RNG state: written before the manifest would have been, or never
    assert (ckpt / "step-00000007" / "rng_state_rank00001.pt").exists() == (point == "kill-before-manifest")
    assert (ckpt / "latest").read_text() == "step-00000006"
    resumed = run_trainer(ckpt, EVERY_STEP)
    assert_ok(resumed)
    assert "warning: checkpoint: incomplete checkpoint moved aside: step-00000007 -> incomplete/step-00000007 (" \
        in resumed.output
    assert "resume: continuing from" in resumed.output and "step-00000006" in resumed.output.split("continuing")[1]
    assert (ckpt / "incomplete" / "step-00000007").is_dir()  # kept as the crash left it
    assert not (ckpt / "incomplete" / "step-00000007" / "manifest.json").exists()
    assert inspect_checkpoint(ckpt / "step-00000007").complete  # written again by the resumed run
    _assert_continues_exactly(baseline, resumed, 6)


def test_kill_9_after_the_manifest_before_latest_moves(baseline, tmp_path):
    """The manifest is the commit point: step 7 is complete although `latest` still names step 6."""
    ckpt = tmp_path / "ckpt"
    first = run_with_fault(ckpt, EVERY_STEP, "kill-after-manifest:0:7")
    assert first.returncodes[0] == -9
    assert inspect_checkpoint(ckpt / "step-00000007").complete and (ckpt / "latest").read_text() == "step-00000006"
    resumed = run_trainer(ckpt, EVERY_STEP)
    assert_ok(resumed)
    assert "resume: continuing from" in resumed.output and "step 7" in resumed.output.split("resume: continuing")[1]
    _assert_continues_exactly(baseline, resumed, 7)


@pytest.mark.parametrize("fault, stopped_at", [("usr1-in-save:0:5", 6), ("usr1-in-eval:1:3", 3)],
                         ids=["during-a-save", "during-evaluation"])
def test_usr1_during_a_save_or_an_evaluation(baseline, tmp_path, fault, stopped_at):
    """The signal is kept until the next step boundary: a save in progress completes, then the run saves the step it
    is at and exits 75 on every rank; the resumed run is exact. (Evaluation at step 3 changes no training state.)"""
    ckpt = tmp_path / "ckpt"
    args = [*RESUME_ARGS, "--eval_interval", "3"]
    first = run_with_fault(ckpt, args, fault)
    assert first.returncodes == [75, 75], first.outputs[0][-3000:]
    assert (ckpt / "latest").read_text() == f"step-{stopped_at:08d}"
    resumed = run_trainer(ckpt, args)
    assert_ok(resumed)
    _assert_continues_exactly(baseline, resumed, stopped_at)
    evals = [r for r in resumed.metrics() if "eval_loss" in r]
    assert {r["step"] for r in evals} >= {6, 9}


def test_kill_9_in_the_first_save_twice_then_a_fresh_start(baseline, tmp_path):
    """Rank 1 dies in the first save of the run (step 5, before its manifest), and again in the rerun's first save:
    each start moves the save cut short aside (step 5, then step 5 again as step-00000005.1) and, with no complete
    checkpoint left, starts from step 0 with a warning; the third start finishes, its losses those of an uninterrupted
    run from step 1."""
    ckpt = tmp_path / "ckpt"
    first = run_with_fault(ckpt, RESUME_ARGS, "kill-before-manifest:1:5")
    assert first.returncodes[1] == -9
    assert (ckpt / "step-00000005").is_dir() and not (ckpt / "latest").exists()
    second = run_with_fault(ckpt, RESUME_ARGS, "kill-before-manifest:1:5")
    assert second.returncodes[1] == -9
    assert "incomplete checkpoint moved aside: step-00000005 -> incomplete/step-00000005 (" in second.output
    assert "STARTS FROM STEP 0" in second.output
    third = run_trainer(ckpt, RESUME_ARGS)
    assert_ok(third)
    fresh_start = next(line for line in third.output.splitlines() if "STARTS FROM STEP 0" in line)
    assert fresh_start.endswith(f"warning: resume: NO complete checkpoint in {ckpt}: 1 incomplete one(s) moved to "
                           f"{ckpt / 'incomplete'}; this run STARTS FROM STEP 0")
    assert "resume: continuing from" not in third.output
    assert sorted(p.name for p in (ckpt / "incomplete").iterdir()) == ["step-00000005", "step-00000005.1"]
    summary = json.loads((ckpt / "summary.json").read_text())
    assert summary["status"] == "completed" and len(summary["incomplete_checkpoints_moved"]) == 1
    assert summary["incomplete_checkpoints_moved"][0].startswith("step-00000005 -> incomplete/step-00000005.1 (")
    assert "incomplete ckpts  1 moved aside at the start: step-00000005 -> incomplete/step-00000005.1" in third.output
    _assert_continues_exactly(baseline, third, 0)


def test_a_binary_latest_falls_back_with_a_warning(baseline, tmp_path):
    """`latest` holds bytes that are not text, and the checkpoint of step 10 is gone: both ranks resume from step 5
    (the newest complete one) with a warning, no traceback, and continue exactly."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(baseline.checkpoint_dir, ckpt)
    shutil.rmtree(ckpt / "step-00000010")
    (ckpt / "latest").write_bytes(b"\x89\xffstep-\x00\x01")
    resumed = run_trainer(ckpt, RESUME_ARGS)
    assert_ok(resumed)
    assert (f"warning: {ckpt / 'latest'} holds 9 bytes that are not text (b'\\x89\\xffstep-\\x00\\x01'...); looking "
            "for the newest complete checkpoint instead") in resumed.output
    assert "Traceback" not in resumed.outputs[0] + resumed.outputs[1]
    assert "step-00000005" in resumed.output.split("resume: continuing from")[1].splitlines()[0]
    assert (ckpt / "latest").read_text() == "step-00000010"
    _assert_continues_exactly(baseline, resumed, 5)


@pytest.fixture
def small_fs(tmp_path):
    """A 200 MiB tmpfs for a checkpoint directory (a tiny checkpoint takes ~50 MB)."""
    yield from mounted_tmpfs(tmp_path / "fs", "200m")


def test_a_full_disk_during_a_save_is_named_with_its_free_bytes(baseline, small_fs, tmp_path):
    """The checkpoint directory's filesystem is filled but 256 KiB just before the save of step 6: the real writes
    fail on both ranks, which exit 1, naming the full disk with its free bytes, those written and a checkpoint's
    size; step 3 stays `latest`, and once space is freed the run resumes from it. The save is synchronous: written in
    the background, the full disk would also refuse the metrics appended meanwhile, at a moment that depends on the
    writer thread (the background path's message is test_background_save's, from an injected ENOSPC). The logs are
    kept off the full filesystem, as a job's usually are."""
    ckpt = small_fs / "ckpt"
    args = [*RESUME_ARGS, "--checkpoint_freq", "3", "--no-background_checkpoint"]
    failed = run_with_fault(ckpt, args, "fill-disk:0:6", log_dir=tmp_path)
    assert failed.returncodes == [1, 1], failed.outputs[0][-3000:]
    assert not any("Traceback" in o for o in failed.outputs), failed.outputs[0][-3000:]
    step3 = sum(inspect_checkpoint(ckpt / "step-00000003").manifest["files"].values())
    errors = [line for o in failed.outputs for line in o.splitlines() if "no space left on the filesystem" in line]
    assert errors and errors[0].split("): ", 1)[1].startswith(
        f"checkpoint step-00000006 could not be written (no space left on the filesystem of {ckpt}: "), errors
    assert f" bytes free of {200 * 2**20:,}; " in errors[0] and " bytes of step-00000006 written so far; " in errors[0]
    assert f"a checkpoint takes about {step3:,} bytes (the size of step-00000003)" in errors[0]
    assert "Fix: free space on the filesystem of" in errors[0]
    assert (ckpt / "latest").read_text() == "step-00000003"
    (ckpt / "filler").unlink()
    resumed = run_trainer(ckpt, args)
    assert_ok(resumed)
    assert "step-00000003" in resumed.output.split("resume: continuing from")[1].splitlines()[0]
    _assert_continues_exactly(baseline, resumed, 3)


def test_a_failed_synchronous_write_on_one_rank_stops_both(tmp_path):
    """Rank 1's files of step 6 cannot be written (ENOSPC, injected at their fsync) in a synchronous save: both ranks
    learn it in the save's own collective and exit 1, rank 1 naming the full disk, rank 0 the other rank; step 3
    stays `latest`."""
    ckpt = tmp_path / "ckpt"
    args = [*RESUME_ARGS, "--checkpoint_freq", "3", "--no-background_checkpoint"]
    failed = run_with_fault(ckpt, args, "disk-full:1:6")
    assert failed.returncodes == [1, 1], failed.outputs[1][-3000:]
    assert not any("Traceback" in o for o in failed.outputs), failed.outputs[0][-3000:]
    assert (f"error (rank 1): checkpoint step-00000006 could not be written (no space left on the filesystem of "
            f"{ckpt}: ") in failed.outputs[1]
    assert ("error (rank 0): checkpoint step-00000006 could not be written (a write failed on another rank); the "
            "previous complete checkpoint stays `latest`. Fix: see the message of the rank whose write failed; then "
            "run again to resume from it") in failed.outputs[0]
    assert (ckpt / "latest").read_text() == "step-00000003"
    assert not (ckpt / "step-00000006" / "manifest.json").exists()


def test_a_manifest_that_cannot_be_written_stops_both_ranks(tmp_path):
    """Every file of step 6 is written, then rank 0 cannot write its manifest (ENOSPC, injected): both ranks exit 1
    together, rank 0 naming the full disk; step 6 stays incomplete and step 3 `latest`."""
    ckpt = tmp_path / "ckpt"
    failed = run_with_fault(ckpt, [*RESUME_ARGS, "--checkpoint_freq", "3"], "manifest-disk-full:0:6")
    assert failed.returncodes == [1, 1], failed.outputs[0][-3000:]
    assert not any("Traceback" in o for o in failed.outputs), failed.outputs[0][-3000:]
    assert (f"error (rank 0): checkpoint step-00000006 could not be written (no space left on the filesystem of "
            f"{ckpt}: ") in failed.outputs[0]
    assert "error (rank 1): checkpoint step-00000006 could not be written (a write failed on another rank)" \
        in failed.outputs[1]
    assert (ckpt / "latest").read_text() == "step-00000003"
    assert not inspect_checkpoint(ckpt / "step-00000006").complete
