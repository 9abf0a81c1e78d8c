"""Runs the trainer (as its __main__) with one fault injected at an exact point, for tests/distributed/test_save_faults.py.

    FAULT=POINT:RANK:STEP python tests/distributed/fault_injection.py TRAINER-FLAGS...

POINT is where the rank RANK acts at step STEP:
  kill-before-manifest   SIGKILL itself once its shards are written and fsynced, before the manifest exists
  kill-in-save           SIGKILL itself once the first of its files is written and fsynced: its other files never are
  kill-after-manifest    (rank 0) SIGKILL itself after writing the manifest, before `latest` moves
  usr1-in-eval           SIGUSR1 to itself inside the evaluation at that step
  usr1-in-save           SIGUSR1 to itself once the first file of that step's checkpoint is written
  disk-full              its writes of that step's checkpoint fail with ENOSPC
The points are found by the checkpoint's step (its directory's name), so they act alike whether the files are written
in the background (--background_checkpoint, the default) or not. FAULT is read by this test program only; the trainer
has no such switch.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
sys.path.insert(0, str(SRC))

from model_utils import background_save, checkpoint, evaluation  # noqa: E402

point, rank, step = os.environ["FAULT"].split(":")
rank, step = int(rank), int(step)
me = int(os.environ["RANK"])


def act(sig):
    sys.stdout.flush()
    os.kill(os.getpid(), sig)


tag = checkpoint.tag_for(step)


def in_this_save(path) -> bool:
    return me == rank and Path(path).parent.name == tag


def on_fsync(act_on):
    """Wrap both fsyncs of a checkpoint's files (a synchronous save's, the background writer's)."""
    def wrap(original):
        def fsync(path):
            original(path)
            if in_this_save(path):
                act_on(Path(path))
        return fsync

    checkpoint._fsync_file = wrap(checkpoint._fsync_file)
    background_save.fsync_path = wrap(background_save.fsync_path)


if point == "kill-before-manifest":
    on_fsync(lambda path: path.name.startswith("rng_state") and act(signal.SIGKILL))  # the rank's last file
elif point == "kill-in-save":
    on_fsync(lambda path: act(signal.SIGKILL))  # the first file fsynced: nothing after it
elif point == "kill-after-manifest":
    original_write = checkpoint.atomic_write_text

    def atomic_write_text(path, text):
        if me == rank and Path(path).name == checkpoint.LATEST and text == tag:
            act(signal.SIGKILL)
        return original_write(path, text)

    checkpoint.atomic_write_text = atomic_write_text
elif point == "usr1-in-save":
    signalled = []
    on_fsync(lambda path: not signalled and (signalled.append(path) or act(signal.SIGUSR1)))  # its first file
elif point == "disk-full":
    original_fsync = background_save.fsync_path

    def fsync_path(path):
        if in_this_save(path):
            raise OSError(28, "No space left on device", str(path))
        original_fsync(path)

    background_save.fsync_path = fsync_path
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
