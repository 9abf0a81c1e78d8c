"""Faults at exact points of a save or an evaluation (injected by tests/distributed/fault_injection.py, not timed by sleeps):
each run resumes from a complete checkpoint and continues with losses bitwise equal to an uninterrupted run."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, TrainerRun, assert_ok, rank_environment, run_trainer
from model_utils.checkpoint import inspect_checkpoint
from model_utils.train_utils import free_port
from test_training import RESUME_ARGS, _assert_continues_exactly, baseline  # noqa: F401 (the fixture)

INJECT = Path(__file__).with_name("fault_injection.py")
EVERY_STEP = [*RESUME_ARGS, "--checkpoint_freq", "1", "--keep_last_checkpoints", "0"]


def run_with_fault(ckpt: Path, args: list[str], fault: str, timeout: float = 300) -> TrainerRun:
    """Both ranks run the trainer through the injector; when one dies, the other is killed too (as srun does)."""
    port, procs, logs = free_port(), [], []
    for rank in range(2):
        env = rank_environment(rank, 2, port, {"FAULT": fault})
        logs.append(ckpt.parent / f"{ckpt.name}-fault-rank{rank}.log")
        procs.append(subprocess.Popen([sys.executable, str(INJECT), "--checkpoint_dir", str(ckpt), *args], cwd=REPO,
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
    assert "skipping incomplete checkpoint step-00000007" in resumed.output
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
