"""Runs the trainer (as its __main__) with one fault injected at an exact point, for tests/distributed/test_save_faults.py.

    FAULT=POINT:RANK:STEP python tests/distributed/fault_injection.py TRAINER-FLAGS...

POINT is where the rank RANK acts at step STEP:
  kill-before-manifest   SIGKILL itself once its shards are written and fsynced, before the manifest exists
  kill-in-save           SIGKILL itself once the first of its files is written and fsynced: its other files never are
  kill-after-manifest    (rank 0) SIGKILL itself after writing the manifest, before `latest` moves
  pause-before-manifest  stop writing forever once its shards are written and fsynced, before the manifest exists
                         (the save stays incomplete until something kills the run: a test's scancel)
  usr1-in-eval           SIGUSR1 to itself inside the evaluation at that step
  usr1-in-save           SIGUSR1 to itself once the first file of that step's checkpoint is written
  disk-full              its writes of that step's checkpoint fail with ENOSPC (in the background writer, or the
                         synchronous save's fsync of its files)
  manifest-disk-full     (rank 0) writing that step's manifest fails with ENOSPC (its files are all written)
  fill-disk              before that step's save, fill the filesystem of --checkpoint_dir but 256 KiB (a file
                         `filler` there): the save's writes then meet a real full disk
  slow-write             its background writes of that step's checkpoint hold its last file until the next save (or
                         the run's end) begins, then take 1 s more: a disk slower than the interval between saves
The points are found by the checkpoint's step (its directory's name), so they act alike whether the files are written
in the background (--background_checkpoint, the default) or not. FAULT is read by this test program only; the trainer
has no such switch.
"""

from __future__ import annotations

import errno
import os
import runpy
import shutil
import signal
import sys
import time
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
sys.path.insert(0, str(SRC))

# The faults go where the trainer calls what they replace: the checkpoint protocol's and the save's file writes, the
# loop's save and evaluation.
from model_utils.checkpoint import background as background_save  # noqa: E402
from model_utils.checkpoint import save as checkpoint_save  # noqa: E402
from model_utils.core import run_dir  # noqa: E402
from model_utils.train import loop  # noqa: E402

point, rank, step = os.environ["FAULT"].split(":")
rank, step = int(rank), int(step)
me = int(os.environ["RANK"])


def act(sig):
    sys.stdout.flush()
    os.kill(os.getpid(), sig)


tag = run_dir.checkpoint_name(step)


def in_this_save(path) -> bool:
    return me == rank and Path(path).parent.name == tag


def no_space(path):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


def on_fsync(act_on):
    """Wrap both fsyncs of a checkpoint's files (a synchronous save's, the background writer's)."""
    def wrap(original):
        def fsync(path):
            original(path)
            if in_this_save(path):
                act_on(Path(path))
        return fsync

    checkpoint_save.fsync_file = wrap(checkpoint_save.fsync_file)
    background_save.fsync_path = wrap(background_save.fsync_path)


if point == "kill-before-manifest":
    on_fsync(lambda path: path.name.startswith("rng_state") and act(signal.SIGKILL))  # the rank's last file
elif point == "pause-before-manifest":
    def pause(path):
        if path.name.startswith("rng_state"):  # the rank's last file
            sys.stdout.flush()
            while True:
                time.sleep(3600)

    on_fsync(pause)
elif point == "kill-in-save":
    on_fsync(lambda path: act(signal.SIGKILL))  # the first file fsynced: nothing after it
elif point == "kill-after-manifest":
    original_write = checkpoint_save.atomic_write_text

    def atomic_write_text(path, text):
        if me == rank and Path(path).name == run_dir.LATEST and text == tag:
            act(signal.SIGKILL)
        return original_write(path, text)

    checkpoint_save.atomic_write_text = atomic_write_text
elif point == "usr1-in-save":
    signalled = []
    on_fsync(lambda path: not signalled and (signalled.append(path) or act(signal.SIGUSR1)))  # its first file
elif point == "disk-full":
    on_fsync(no_space)
elif point == "manifest-disk-full":
    original_write_text = checkpoint_save.atomic_write_text

    def atomic_write_text(path, text):
        if me == rank and Path(path).name == run_dir.MANIFEST and Path(path).parent.name == tag:
            no_space(path)
        return original_write_text(path, text)

    checkpoint_save.atomic_write_text = atomic_write_text
elif point == "fill-disk":
    original_save = loop.save_checkpoint

    def save_checkpoint(engine, ctx, at_step, *args, **kwargs):
        if me == rank and at_step == step:  # before the save's first barrier: no rank has written yet
            free = shutil.disk_usage(ctx.ckpt_dir).free
            with open(ctx.ckpt_dir / "filler", "wb") as f:
                os.posix_fallocate(f.fileno(), 0, free - 256 * 1024)
        return original_save(engine, ctx, at_step, *args, **kwargs)

    loop.save_checkpoint = save_checkpoint
elif point == "slow-write":
    import threading

    next_save = threading.Event()
    original_finish = background_save.BackgroundSaves.finish

    def finish(self):  # the loop finishes the checkpoint in flight before the next save, and at the end
        if self.pending is not None and self.pending.path.name == tag:
            next_save.set()
        return original_finish(self)

    def hold(path):
        if path.name.startswith("rng_state"):  # the rank's last file
            next_save.wait(timeout=120)
            time.sleep(1.0)

    background_save.BackgroundSaves.finish = finish
    on_fsync(hold)
elif point == "usr1-in-eval":
    original_loss = loop.evaluation_loss
    evaluated = {"done": False}

    def evaluation_loss(engine, model, batch):
        if me == rank and not evaluated["done"] and engine.global_steps == step:
            evaluated["done"] = True
            act(signal.SIGUSR1)
        return original_loss(engine, model, batch)

    loop.evaluation_loss = evaluation_loss
else:
    raise SystemExit(f"unknown FAULT point {point}")

sys.argv = [str(SRC / "train_deepspeed.py"), *sys.argv[1:]]
runpy.run_path(sys.argv[0], run_name="__main__")
