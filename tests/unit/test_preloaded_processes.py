"""The tests' preloaded processes (tests/preloaded.py): a program forked from the server sees what a fresh interpreter
would (argv, path, environment, working directory, streams, thread count, exit status), and what the server cannot give
exactly starts a real interpreter."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import preloaded
import pytest

PROBE = """
import json, os, sys
forked = "torch" in sys.modules  # the server's: imported before the program ran
import torch
print(json.dumps({"argv": sys.argv, "path0": sys.path[0], "cwd": os.getcwd(), "rank": os.environ.get("RANK"),
                  "threads": torch.get_num_threads(), "forked": forked,
                  "pythonpath_first": sys.path[1] if len(sys.path) > 1 else None}))
print("to stderr", file=sys.stderr)
"""


def probe(tmp_path, args=(), env=None, **kwargs):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    if not (env or {}).get("DSLM_TEST_FRESH_PROCESSES"):
        assert preloaded.why_not_forked([sys.executable, str(script)], env) is None
    done = preloaded.run([sys.executable, str(script), *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120, **kwargs)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1]), done


def test_a_forked_program_sees_what_a_fresh_interpreter_would(tmp_path):
    """The first test to fork starts the session's server (~8 s of imports), and the fresh side imports torch."""
    env = dict(os.environ, RANK="1", OMP_NUM_THREADS="1")
    fresh_env = dict(env, DSLM_TEST_FRESH_PROCESSES="1")
    forked, done = probe(tmp_path, ["--flag", "x"], env=env)
    assert forked["forked"]
    assert done.stderr.strip().endswith("to stderr")
    fresh, _ = probe(tmp_path, ["--flag", "x"], env=fresh_env)
    assert not fresh["forked"]
    for key in ("argv", "path0", "cwd", "rank", "threads"):
        assert forked[key] == fresh[key], key
    assert forked["threads"] == 1


def test_pythonpath_comes_after_the_programs_folder_as_in_a_fresh_interpreter(tmp_path):
    extra = tmp_path / "extra"
    extra.mkdir()
    forked, _ = probe(tmp_path, env=dict(os.environ, PYTHONPATH=str(extra)))
    assert forked["forked"] and forked["pythonpath_first"] == str(extra)


EXITS = {"raise SystemExit(3)": 3, "raise SystemExit('bad input')": 1, "raise ValueError('boom')": 1,
         "import os; os._exit(75)": 75, "pass": 0}


def test_exit_statuses_are_the_interpreters(tmp_path):
    """Each program ends through the interpreter's own exit (threads joined, atexit, finalization: ~2 s of a core
    with torch loaded), so the five run side by side."""
    outputs = {code: open(tmp_path / f"{n}.err", "w+") for n, code in enumerate(EXITS)}
    procs = {code: preloaded.Popen([sys.executable, "-c", code], stderr=outputs[code]) for code in EXITS}
    for code, status in EXITS.items():
        assert isinstance(procs[code], preloaded.PreloadedProcess)
        assert procs[code].wait(timeout=120) == status, code
        outputs[code].seek(0)
        stderr = outputs[code].read()
        assert ("ValueError: boom" in stderr) == ("ValueError" in code), stderr
        assert ("bad input" in stderr) == ("bad input" in code), stderr


def test_a_signal_ends_it_as_subprocess_reports(tmp_path):
    args = [sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"]
    assert preloaded.why_not_forked(args) is None
    proc = preloaded.Popen(args, stdout=subprocess.PIPE, text=True)
    assert isinstance(proc, preloaded.PreloadedProcess)
    assert proc.stdout.readline().strip() == "up" and proc.poll() is None
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=30) == -signal.SIGKILL


def test_a_timeout_is_subprocesss():
    proc = preloaded.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(timeout=0.2)
    proc.kill()
    assert proc.wait(timeout=30) == -signal.SIGKILL


@pytest.mark.parametrize("change", [{"HF_HOME": "/elsewhere"}, {"TORCH_EXTENSIONS_DIR": "/elsewhere"},
                                    {"CUDA_VISIBLE_DEVICES": "0"}])
def test_an_environment_read_at_import_starts_a_real_interpreter(change):
    """What the server's libraries read when it imported them cannot change in a fork: a real process."""
    proc = preloaded.Popen([sys.executable, "-c", "pass"], env=dict(os.environ, **change))
    assert isinstance(proc, subprocess.Popen) and proc.wait(timeout=60) == 0
    assert isinstance(preloaded.Popen([sys.executable, "-X", "importtime", "-c", "pass"],
                                      stderr=subprocess.DEVNULL), subprocess.Popen)
