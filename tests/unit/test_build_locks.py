"""A lock left in torch's extension folder by a DeepSpeed op build that was killed (CPU Adam, the CPU ranks'
shared-memory collectives) makes every later process that needs the op wait for it, silently and forever: the run
refuses to start instead, naming the file and the fix (model_utils.train_utils.stale_build_lock_problems)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from conftest import TRAINER

from model_utils import train_utils


def _lock(root, op, age_s):
    lock = root / "py311_cpu" / op / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    then = time.time() - age_s
    os.utime(lock, (then, then))
    return lock


def test_only_a_lock_no_build_can_still_hold_is_a_problem(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    stale = _lock(tmp_path, "cpu_adam", train_utils.STALE_BUILD_LOCK_S + 60)
    _lock(tmp_path, "deepspeed_shm_comm", 30)  # a build in progress holds it
    (tmp_path / "py311_cpu" / "fused_adam").mkdir()  # a finished build: no lock
    [problem] = train_utils.stale_build_lock_problems()
    assert problem.setting == "TORCH_EXTENSIONS_DIR" and problem.value == str(tmp_path)
    assert f"{stale} is 16 minutes old: a build of the cpu_adam op was stopped" in problem.message
    assert f"rm {stale}" in problem.fix
    assert train_utils.stale_build_lock_problems(now=time.time() - 3600) == []  # before it went stale


def test_a_run_refuses_to_start_instead_of_waiting_for_a_stale_lock(tmp_path):
    lock = _lock(tmp_path, "deepspeed_shm_comm", 3600)
    run = subprocess.run([sys.executable, str(TRAINER), "--model", "tiny", "--max_steps", "1",
                          "--checkpoint_dir", str(tmp_path / "ckpt")],
                         env=dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path)), capture_output=True, text=True,
                         timeout=300)
    out = run.stdout + run.stderr
    assert run.returncode == 2, out
    assert f"{lock} is 60 minutes old" in out and "nothing was started" in out and "Traceback" not in out
    assert not (tmp_path / "ckpt").exists()


def test_the_preflight_names_a_stale_lock_before_the_job_queues(tmp_path, monkeypatch, capsys, session_cache):
    """--preflight on a login node that shares the home folder with the GPU nodes reports the lock a run would wait
    for, with the same fix, before any allocation."""
    import train_deepspeed

    lock = _lock(tmp_path / "ext", "cpu_adam", 3600)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    monkeypatch.setenv("WORLD_SIZE", "1")
    code = train_deepspeed.main(["--preflight", "--model", "tiny", "--checkpoint_dir", str(tmp_path / "ckpt")])
    out = capsys.readouterr().out
    assert code == 2, out
    assert f"{lock} is 60 minutes old" in out and f"rm {lock}" in out
    lock.unlink()
    assert train_deepspeed.main(["--preflight", "--model", "tiny", "--checkpoint_dir", str(tmp_path / "ckpt")]) == 0
