"""Runs the trainer (as its __main__) with one fault injected at an exact point, for tests/test_save_faults.py.

    FAULT=POINT:RANK:STEP python tests/fault_injection.py TRAINER-FLAGS...

POINT is where the rank RANK acts at step STEP:
  kill-before-manifest   SIGKILL itself once its shards are written and fsynced, before the manifest exists
  kill-after-manifest    (rank 0) SIGKILL itself after writing the manifest, before `latest` moves
  usr1-in-eval           SIGUSR1 to itself inside the evaluation at that step
  usr1-in-save           SIGUSR1 to itself while that step's checkpoint is being written
FAULT is read by this test program only; the trainer has no such switch.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
sys.path.insert(0, str(SRC))

from model_utils import checkpoint, evaluation  # noqa: E402

point, rank, step = os.environ["FAULT"].split(":")
rank, step = int(rank), int(step)
me = int(os.environ["RANK"])
saving = {"step": None}


def act(sig):
    sys.stdout.flush()
    os.kill(os.getpid(), sig)


original_save = checkpoint.save_checkpoint


def save_checkpoint(engine, ctx, at_step, *args, **kw):
    saving["step"] = at_step
    try:
        return original_save(engine, ctx, at_step, *args, **kw)
    finally:
        saving["step"] = None


checkpoint.save_checkpoint = save_checkpoint

if point == "kill-before-manifest":
    original_fsync = checkpoint._fsync_file
    fsynced = []

    def _fsync_file(path):
        original_fsync(path)
        fsynced.append(path)
        if me == rank and saving["step"] == step and Path(path).name.startswith("rng_state"):  # its last file
            act(signal.SIGKILL)

    checkpoint._fsync_file = _fsync_file
elif point == "kill-after-manifest":
    original_write = checkpoint.atomic_write_text

    def atomic_write_text(path, text):
        if me == rank and saving["step"] == step and Path(path).name == checkpoint.LATEST:
            act(signal.SIGKILL)
        return original_write(path, text)

    checkpoint.atomic_write_text = atomic_write_text
elif point == "usr1-in-save":
    original_rng = checkpoint.rng_state_file

    def rng_state_file(path, at_rank):
        if me == rank and saving["step"] == step:
            act(signal.SIGUSR1)
        return original_rng(path, at_rank)

    checkpoint.rng_state_file = rng_state_file
elif point == "usr1-in-eval":
    original_loss = evaluation.evaluation_loss
    evaluated = {"done": False}

    def evaluation_loss(engine, model, batch):
        if me == rank and not evaluated["done"] and engine.global_steps == step:
            evaluated["done"] = True
            act(signal.SIGUSR1)
        return original_loss(engine, model, batch)

    evaluation.evaluation_loss = evaluation_loss
else:
    raise SystemExit(f"unknown FAULT point {point}")

sys.argv = [str(SRC / "train_deepspeed.py"), *sys.argv[1:]]
runpy.run_path(sys.argv[0], run_name="__main__")
