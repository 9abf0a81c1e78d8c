"""One run per checkpoint directory (model_utils.runtime.run_lock): a second run refuses at once naming the holder;
dead, stale, requeued and forced holders are taken over."""

from __future__ import annotations

import json
import os
import socket
import time

from inputs import write_lock

from model_utils.core.run_dir import LOCK
from model_utils.runtime import run_lock
from model_utils.runtime.run_lock import STALE_S, acquire, why_takeable


def test_who_may_take_a_lock_over(monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    alive_elsewhere = {"host": "node-elsewhere", "pid": 1, "job_id": "12"}
    assert why_takeable(alive_elsewhere, 10, force=False) is None
    assert why_takeable(alive_elsewhere, STALE_S + 1, force=False).startswith("its heartbeat stopped")
    assert why_takeable(alive_elsewhere, 10, force=True) == "--force_unlock"
    assert "same SLURM job 77" in why_takeable({**alive_elsewhere, "job_id": "77"}, 10, force=False)
    dead_here = {"host": socket.gethostname(), "pid": 2**22 + 12345, "job_id": "12"}  # no such pid
    assert "is gone" in why_takeable(dead_here, 10, force=False)
    assert why_takeable({**dead_here, "pid": os.getpid()}, 10, force=False) is None  # this very process: alive


def test_acquire_heartbeat_and_release(tmp_path, monkeypatch):
    monkeypatch.setattr(run_lock, "HEARTBEAT_S", 0.1)
    lock, problem = acquire(str(tmp_path / "ckpt"), False, print)
    assert problem is None and json.loads(lock.path.read_text())["pid"] == os.getpid()
    os.utime(lock.path, (0, 0))
    time.sleep(0.5)
    assert time.time() - lock.path.stat().st_mtime < 5  # the heartbeat touched it
    second, problem = acquire(str(tmp_path / "ckpt"), False, print)  # same host and pid: alive, so refused
    assert second is None and "is in use by another run" in problem.message and f"pid {os.getpid()}" in problem.message
    lock.release()
    assert not lock.path.exists()


def test_release_leaves_a_lock_taken_over_by_another_run(tmp_path):
    lock, _ = acquire(str(tmp_path), False, print)
    write_lock(tmp_path, token="someone else's")  # --force_unlock by another run replaced it
    lock.release()
    assert (tmp_path / LOCK).exists()
