"""A rank that dies in native code: what its log keeps."""

from __future__ import annotations

import re
import signal

from conftest import Trainer


def test_a_rank_that_dies_in_native_code_leaves_its_threads_stacks(tmp_path, session_cache):
    """A SIGABRT (as a C++ library's std::terminate raises it) ends the rank with that signal, after the trainer's
    faulthandler has written every thread's Python stack to the rank's log. PYTHONFAULTHANDLER is unset: the trainer
    enables it itself."""
    run = Trainer(tmp_path / "ck", ["--max_steps", "400", "--seq_len", "64", "--micro_batch_size", "2",
                                    "--log_interval", "1", "--eval_interval", "0", "--checkpoint_freq", "1000"],
                  nproc=1, env={"PYTHONFAULTHANDLER": None})
    assert run.wait_for(lambda: "step 2 |" in run.logs[0].read_text(), timeout=300)
    run.procs[0].send_signal(signal.SIGABRT)
    result = run.wait(timeout=120)
    assert result.returncode == -signal.SIGABRT, result.output[-3000:]
    assert "Fatal Python error: Aborted" in result.output, result.output[-3000:]
    assert re.search(r'File ".*train_deepspeed\.py", line \d+ in main', result.output), result.output[-3000:]
