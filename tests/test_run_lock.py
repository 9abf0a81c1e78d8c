"""One run per checkpoint directory (model_utils.run_lock): a second run refuses at once naming the holder; dead,
stale, requeued and forced holders are taken over."""

from __future__ import annotations

import json
import os
import socket
import time

import pytest

from conftest import FAST_ARGS, Trainer, assert_ok, run_trainer
from model_utils import run_lock
from model_utils.run_lock import LOCK_FILE, STALE_S, acquire, why_takeable


def write_lock(directory, age_s=0.0, **holder):
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / LOCK_FILE
    path.write_text(json.dumps({"host": "node-elsewhere", "pid": 4242, "job_id": None, "started": "earlier",
                                "token": "theirs", **holder}))
    past = time.time() - age_s
    os.utime(path, (past, past))
    return path


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
    assert (tmp_path / LOCK_FILE).exists()


@pytest.mark.slow
def test_second_run_on_the_same_directory_refuses_at_once(session_cache, tmp_path):
    ckpt = tmp_path / "ckpt"
    args = [*FAST_ARGS, "--max_steps", "60", "--checkpoint_freq", "20", "--no-export"]
    first = Trainer(ckpt, args)
    assert first.wait_for(lambda: (ckpt / "metrics.jsonl").exists())  # training
    t0 = time.monotonic()
    second = run_trainer(ckpt, args)
    refused_in = time.monotonic() - t0
    holder = json.loads((ckpt / LOCK_FILE).read_text())
    assert second.returncode == 2 and "Traceback" not in second.output
    assert f"--checkpoint_dir = {ckpt}: is in use by another run (host {socket.gethostname()}, pid {holder['pid']}" \
           in second.output and "--force_unlock" in second.output
    assert holder["pid"] == first.procs[0].pid  # rank 0 of the first run holds it
    assert refused_in < 60
    first_run = first.wait()
    assert_ok(first_run)
    assert [r["step"] for r in first_run.train_records()] == list(range(1, 61))  # untouched by the second
    assert not (ckpt / LOCK_FILE).exists()  # released at the end


@pytest.mark.slow
@pytest.mark.parametrize("age, extra, taken", [(STALE_S + 60, [], True), (0, [], False), (0, ["--force_unlock"], True)],
                         ids=["stale", "alive-elsewhere", "forced"])
def test_locks_of_other_hosts(session_cache, tmp_path, age, extra, taken):
    ckpt = tmp_path / "ckpt"
    write_lock(ckpt, age_s=age)
    run = run_trainer(ckpt, [*FAST_ARGS, "--max_steps", "2", "--no-export", *extra])
    if taken:
        assert_ok(run)
        assert "run lock: taking over" in run.output and "node-elsewhere pid 4242" in run.output
    else:
        assert run.returncode == 2 and "is in use by another run (host node-elsewhere, pid 4242" in run.output
        assert (ckpt / LOCK_FILE).exists()  # theirs, left alone
