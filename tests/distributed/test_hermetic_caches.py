"""The suite's caches are its own (tests/conftest.py's CACHE_SETTINGS): what another environment left in the user's
~/.cache changes no test's outcome. Nothing is mocked: real trainers on 2 gloo ranks, with HOME pointing at a
poisoned home folder."""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

import torch
from conftest import CACHE_SETTINGS, FAST_ARGS, assert_ok, copy_session_op, run_trainer

from model_utils.runtime.build_locks import torch_locks_with_os_lock

# ZeRO-2 with the optimizer offloaded: the run needs DeepSpeed's cpu_adam op, which torch builds (or loads) in its
# extension folder under a `lock` file.
ARGS = [*FAST_ARGS, "--ds_config", "configs/zero2-offload.json", "--max_steps", "2", "--checkpoint_freq", "0",
        "--no-export"]


def build_folder_name() -> str:
    """torch's folder for this interpreter's ops under its default root (torch.utils.cpp_extension's
    _get_build_directory): py311_cpu and the like."""
    cuda = "cpu" if torch.version.cuda is None else f"cu{torch.version.cuda.replace('.', '')}"
    return f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}_{cuda}"


def poisoned_home(home: Path, session_cache: Path) -> Path:
    """A home whose ~/.cache holds an hour-old cpu_adam build lock (a build killed long ago: every process needing
    cpu_adam would wait on it forever) and a corrupt dataset cache (the session's files, each overwritten); the
    lock's path."""
    lock = home / ".cache" / "torch_extensions" / build_folder_name() / "cpu_adam" / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    an_hour_ago = time.time() - 3600
    os.utime(lock, (an_hour_ago, an_hour_ago))
    # The ranks' shared-memory collectives op, which DeepSpeed builds at the start of every CPU run: the session's
    # build, so that the control run below does not spend ~40 s of a core building it again before it meets the poison.
    copy_session_op("deepspeed_shm_comm", lock.parents[1])
    data = shutil.copytree(session_cache, home / ".cache" / "deepspeed-lm")
    for path in data.rglob("*"):
        if path.is_file():
            path.write_bytes(b"not a token cache")
    return lock


def snapshot(folder: Path) -> dict:
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*")}


def test_a_poisoned_user_cache_changes_no_run(session_cache, tmp_path):
    """Real interpreters (their environment differs from the session's in what the libraries read at import): about
    30 s of a core in each run's starts."""
    home = tmp_path / "home"
    lock = poisoned_home(home, session_cache)
    before = snapshot(home)
    user = {"HOME": str(home), "XDG_CACHE_HOME": None}

    run = run_trainer(tmp_path / "ckpt", ARGS, env=user)
    assert_ok(run)
    assert [r["step"] for r in run.train_records()] == [1, 2]
    assert "DeepSpeedCPUAdam" in run.output  # the op the lock would have blocked was built or loaded
    # in the session's extension folder (under TORCH_EXTENSIONS_DIR torch adds no <python>_<cuda> folder)
    assert (Path(os.environ["TORCH_EXTENSIONS_DIR"]) / "cpu_adam").is_dir()
    assert snapshot(home) == before  # the home folder was neither read into nor written

    # The control: the same run where the suite's cache settings are not set meets the poison and stops (exit 2) naming
    # it: with a FileBaton torch (<= 2.13) the lock, at the start; a torch >= 2.14 ignores a lock file nobody holds
    # (model_utils.runtime.build_locks) and meets the corrupt dataset cache. So the run above passed because of the
    # settings, not because the poison is harmless.
    unset = {name: None for name in CACHE_SETTINGS}
    control = run_trainer(tmp_path / "control", ARGS, env={**user, **unset}, timeout=300)
    assert control.returncode == 2, control.output[-3000:]
    if torch_locks_with_os_lock(torch.__version__):
        assert f"{home / '.cache' / 'deepspeed-lm'}" in control.output and "is not valid JSON" in control.output
    else:
        assert str(lock) in control.output and "TORCH_EXTENSIONS_DIR" in control.output
