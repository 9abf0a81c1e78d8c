"""DeepSpeed's op builds (CPU Adam, the CPU ranks' shared-memory collectives) take `<op>/lock` in torch's extensions
folder. What a file left there means depends on how the running torch locks (model_utils.runtime.build_locks): with
FileBaton (torch <= 2.13) an old file is a killed build that every later process would wait for forever, so the run
refuses to start, naming the file and the fix; with an OS lock (torch >= 2.14) the file stays after every build and only
a held lock is a build in progress, so a free file of any age is no problem.

The lock files here are real: made by filelock (what torch >= 2.14 uses) and by torch's FileBaton, held by another
process where a test needs a held lock."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import TRAINER, copy_session_op

from model_utils.runtime import build_locks

FILEBATON_TORCH = "2.13.0"
OS_LOCK_TORCH = "2.14.1"
HOUR = 3600


def _age(path: Path, age_s: float) -> Path:
    then = time.time() - age_s
    os.utime(path, (then, then))
    return path


def filelock_lock(op_dir: Path, age_s: float) -> Path:
    """The file torch >= 2.14 leaves after a build: filelock acquired and released it."""
    from filelock import FileLock

    op_dir.mkdir(parents=True, exist_ok=True)
    with FileLock(op_dir / "lock"):
        pass
    return _age(op_dir / "lock", age_s)


def baton_lock(op_dir: Path, age_s: float) -> Path:
    """The file a FileBaton build killed mid-way leaves: the baton taken and never released."""
    from torch.utils.file_baton import FileBaton

    op_dir.mkdir(parents=True, exist_ok=True)
    assert FileBaton(str(op_dir / "lock")).try_acquire()
    return _age(op_dir / "lock", age_s)


@pytest.fixture
def default_layout(tmp_path, monkeypatch) -> Path:
    """No TORCH_EXTENSIONS_DIR: torch builds in <cache>/torch_extensions/<python+accelerator>/<op>/."""
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return build_locks.build_directory()


@pytest.fixture
def extensions_dir_layout(tmp_path, monkeypatch) -> Path:
    """TORCH_EXTENSIONS_DIR set (common on clusters): torch builds in <dir>/<op>/, no version folder."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    return build_locks.build_directory()


def test_the_build_directory_is_the_one_torch_builds_in(default_layout, monkeypatch, tmp_path):
    """The layout equals torch's own (its private _get_build_directory, called here only to compare), in both
    layouts."""
    from torch.utils.cpp_extension import _get_build_directory

    assert default_layout == Path(_get_build_directory("cpu_adam", verbose=False)).parent
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    assert build_locks.build_directory() == Path(_get_build_directory("cpu_adam", verbose=False)).parent


def test_the_running_torch_locks_the_way_it_is_judged():
    """torch_locks_with_os_lock's version rule matches what the installed torch's JIT builder imports."""
    from torch.utils import cpp_extension

    os_lock = build_locks.torch_locks_with_os_lock(torch.__version__)
    assert hasattr(cpp_extension, "FileLock") == os_lock
    assert hasattr(cpp_extension, "FileBaton") == (not os_lock)
    assert build_locks.torch_locks_with_os_lock("2.14.1+cu130") and build_locks.torch_locks_with_os_lock("2.15.0")
    assert not build_locks.torch_locks_with_os_lock("2.13.0+cpu") and not build_locks.torch_locks_with_os_lock("2.11.0")


@pytest.mark.parametrize("layout", ["default_layout", "extensions_dir_layout"])
def test_with_filebaton_an_old_free_lock_is_a_problem_and_a_young_one_is_not(layout, request):
    root = request.getfixturevalue(layout)
    stale = baton_lock(root / "cpu_adam", build_locks.STALE_BUILD_LOCK_S + 60)
    baton_lock(root / "deepspeed_shm_comm", 30)  # a build in progress holds it
    (root / "fused_adam").mkdir()  # a finished build: no lock
    [problem] = build_locks.stale_build_lock_problems(torch_version=FILEBATON_TORCH)
    assert problem.setting == "TORCH_EXTENSIONS_DIR" and problem.value == str(root)
    assert f"{stale} is 16 minutes old: a build of the cpu_adam op was stopped" in problem.message
    assert f"rm {stale}" in problem.fix
    # before it went stale
    assert build_locks.stale_build_lock_problems(now=time.time() - HOUR, torch_version=FILEBATON_TORCH) == []


@pytest.mark.parametrize("layout", ["default_layout", "extensions_dir_layout"])
@pytest.mark.parametrize("make_lock", [filelock_lock, baton_lock])
def test_with_an_os_lock_a_free_lock_file_of_any_age_is_no_problem(layout, make_lock, request):
    root = request.getfixturevalue(layout)
    make_lock(root / "cpu_adam", 10 * HOUR)
    make_lock(root / "deepspeed_shm_comm", HOUR)
    assert build_locks.stale_build_lock_problems(torch_version=OS_LOCK_TORCH) == []


def test_a_held_lock_is_a_build_in_progress_for_an_os_lock_torch_and_forever_for_a_filebaton_one(default_layout):
    """Another process holds the OS lock on an hour-old file: for an OS-lock torch a build in progress, not a problem;
    a FileBaton torch would wait for the file, which that build keeps, forever: a problem naming it."""
    lock = filelock_lock(default_layout / "cpu_adam", HOUR)
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from filelock import FileLock\n"
        f"with FileLock({str(lock)!r}):\n    print('held', flush=True); time.sleep(60)")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        _age(lock, HOUR)
        assert build_locks.is_held(lock)
        assert build_locks.stale_build_lock_problems(torch_version=OS_LOCK_TORCH) == []
        [problem] = build_locks.stale_build_lock_problems(torch_version=FILEBATON_TORCH)
        assert f"{lock} is held by a build of the cpu_adam op" in problem.message
        assert "its own TORCH_EXTENSIONS_DIR" in problem.fix
        assert build_locks.leftover_locks(torch_version=FILEBATON_TORCH) == []  # held: never removed
    finally:
        holder.kill()
        holder.wait()
    assert not build_locks.is_held(lock)  # the kernel released it with its holder


@pytest.mark.parametrize("layout", ["default_layout", "extensions_dir_layout"])
@pytest.mark.parametrize("age_s", [60, HOUR])
def test_a_file_an_os_lock_torch_left_after_its_build_is_removed_for_a_filebaton_torch(layout, age_s, request):
    """Two environments share a build directory (same Python and CUDA version): a torch >= 2.14 built the op and left
    its lock file, which a torch <= 2.13 would wait for forever. Its build finished (the module is as new as the
    lock), so the run removes it and says so; a file of a killed FileBaton build (no module newer than it) stays."""
    root = request.getfixturevalue(layout)
    leftover = filelock_lock(root / "deepspeed_shm_comm", age_s)
    module = root / "deepspeed_shm_comm" / "deepspeed_shm_comm.so"
    module.write_bytes(b"")
    _age(module, age_s - 30)  # written 30 s after the lock was taken
    killed = baton_lock(root / "cpu_adam", age_s)
    _age(root / "cpu_adam" / "lock", age_s)
    old_module = root / "cpu_adam" / "cpu_adam.so"
    old_module.write_bytes(b"")
    _age(old_module, age_s + 60)  # an earlier build's module: the lock was taken after it, by a rebuild

    problems = build_locks.stale_build_lock_problems(torch_version=FILEBATON_TORCH)
    assert [str(killed) in p.message for p in problems] == ([True] if age_s >= build_locks.STALE_BUILD_LOCK_S else [])
    assert build_locks.leftover_locks(torch_version=OS_LOCK_TORCH) == []  # an OS-lock torch leaves the files be
    said = []
    build_locks.remove_leftover_locks(said.append, torch_version=FILEBATON_TORCH)
    assert not leftover.exists() and killed.exists()
    assert len(said) == 1 and f"removed {leftover}" in said[0] and "deepspeed_shm_comm build it guarded finished" in said[0]


def test_only_the_running_torchs_build_folder_is_looked_at(default_layout):
    """Locks another Python or CUDA build of torch left in its own folder do not concern this one."""
    baton_lock(default_layout.parent / "py39_cu118" / "cpu_adam", HOUR)
    assert build_locks.stale_build_lock_problems(torch_version=FILEBATON_TORCH) == []
    mine = baton_lock(default_layout / "cpu_adam", HOUR)
    [problem] = build_locks.stale_build_lock_problems(torch_version=FILEBATON_TORCH)
    assert str(mine) in problem.message


def _trainer(tmp_path, env, *extra):
    return subprocess.run([sys.executable, str(TRAINER), "--model", "tiny", "--max_steps", "2", "--seq_len", "64",
                           "--micro_batch_size", "2", "--eval_interval", "0", "--eval_iters", "1",
                           "--checkpoint_dir", str(tmp_path / "ckpt"), *extra],
                          env=dict(os.environ, **env), capture_output=True, text=True, timeout=600)


def test_an_hour_old_lock_refuses_a_run_only_where_torch_would_wait_for_it(tmp_path, session_cache):
    """The installed torch decides: with FileBaton the run exits 2 before starting anything, naming the file and the
    fix; with an OS lock the same file (left by a build long done) does not stop it."""
    os_lock = build_locks.torch_locks_with_os_lock(torch.__version__)
    copy_session_op("deepspeed_shm_comm", tmp_path / "ext")  # the run starts without building it (the baton below)
    lock = baton_lock(tmp_path / "ext" / "deepspeed_shm_comm", HOUR)
    leftover = filelock_lock(tmp_path / "ext" / "fused_adam", HOUR)  # an OS-lock torch's, after a finished build
    (tmp_path / "ext" / "fused_adam" / "fused_adam.so").write_bytes(b"")
    run = _trainer(tmp_path, {"TORCH_EXTENSIONS_DIR": str(tmp_path / "ext"), "WORLD_SIZE": "1"})
    out = run.stdout + run.stderr
    assert "Traceback" not in out
    if os_lock:
        assert run.returncode == 0, out
        assert (tmp_path / "ckpt" / "metrics.jsonl").exists()
        assert leftover.exists() and "op builds: removed" not in out
    else:
        assert run.returncode == 2, out
        assert f"{lock} is 60 minutes old" in out and "nothing was started" in out
        assert not (tmp_path / "ckpt").exists()
        assert not leftover.exists() and f"op builds: removed {leftover}" in out


def test_the_preflight_names_a_stale_lock_before_the_job_queues(tmp_path, monkeypatch, capsys, session_cache):
    """--preflight on a login node that shares the home folder with the GPU nodes reports the lock a FileBaton run
    would wait for, with the same fix, before any allocation; the same file is no problem for an OS-lock torch."""
    import train_deepspeed

    lock = baton_lock(tmp_path / "ext" / "cpu_adam", HOUR)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    monkeypatch.setenv("WORLD_SIZE", "1")
    argv = ["--preflight", "--model", "tiny", "--checkpoint_dir", str(tmp_path / "ckpt")]
    code = train_deepspeed.main(argv)
    out = capsys.readouterr().out
    if build_locks.torch_locks_with_os_lock(torch.__version__):
        assert code == 0, out
        assert str(lock) not in out
    else:
        assert code == 2, out
        assert f"{lock} is 60 minutes old" in out and f"rm {lock}" in out
        lock.unlink()
        assert train_deepspeed.main(argv) == 0
