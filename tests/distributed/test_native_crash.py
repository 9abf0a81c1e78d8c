"""A rank that dies in native code: what its log keeps."""

from __future__ import annotations

import re
import signal
import subprocess
import sys

from conftest import FAST_ARGS, REPO, TRAINER, Trainer, rank_environment, rendezvous_port


def test_a_rank_that_dies_in_native_code_leaves_its_threads_stacks(tmp_path, session_cache):
    """A SIGABRT (as a C++ library's std::terminate raises it) ends the rank with that signal, after the trainer's
    faulthandler has written every thread's Python stack to the rank's log. PYTHONFAULTHANDLER is unset: the trainer
    enables it itself."""
    run = Trainer(tmp_path / "ck", [*FAST_ARGS, "--max_steps", "400", "--checkpoint_freq", "1000"],
                  nproc=1, env={"PYTHONFAULTHANDLER": None})
    assert run.wait_for(lambda: "step 2 |" in run.logs[0].read_text(), timeout=300)
    run.procs[0].send_signal(signal.SIGABRT)
    result = run.wait(timeout=120)
    assert result.returncode == -signal.SIGABRT, result.output[-3000:]
    assert "Fatal Python error: Aborted" in result.output, result.output[-3000:]
    assert re.search(r'File ".*train_deepspeed\.py", line \d+ in main', result.output), result.output[-3000:]


# Runs the trainer as __main__ beside an object whose teardown aborts the process, as a native library's object torn
# down in the interpreter's finalization or the C++ static destructors was seen to do (rank 1 of a finished run:
# "terminate called without an active exception", faulthandler's report holding no Python frame, status 134).
ABORTING_TEARDOWN = '''
import os, runpy, sys


class AbortsWhenTornDown:
    def __del__(self):
        os.abort()


native_object = AbortsWhenTornDown()
sys.argv = [sys.argv[1], *sys.argv[2:]]
runpy.run_path(sys.argv[0], run_name="__main__")
'''


def test_a_finished_rank_exits_with_its_status_whatever_its_teardown_would_do(tmp_path, session_cache):
    """The trainer ends its process once main() has returned and flushed its output, without the interpreter's
    finalization: a finished run exits 0, and bad input exits 2 (exit_on_problems), though an object's teardown
    would abort the process."""
    wrapper = tmp_path / "aborting_teardown.py"
    wrapper.write_text(ABORTING_TEARDOWN)
    env = rank_environment(0, 1, rendezvous_port(), {"PYTHONFAULTHANDLER": None})
    finished = subprocess.run([sys.executable, str(wrapper), str(TRAINER), *FAST_ARGS, "--max_steps", "2",
                               "--checkpoint_dir", str(tmp_path / "ck")],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]
    assert "training finished" in finished.stdout or "run summary" in finished.stdout, finished.stdout[-3000:]
    bad = subprocess.run([sys.executable, str(wrapper), str(TRAINER), "--max_steps", "0",
                          "--checkpoint_dir", str(tmp_path / "ck2")],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "--max_steps" in bad.stderr, bad.stdout[-3000:] + bad.stderr[-3000:]
