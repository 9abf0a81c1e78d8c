"""Python programs started from a process that has imported the trainer's libraries already (tests/preloaded_server.py):
`Popen` and `run` take what subprocess's do for `[sys.executable, SCRIPT_OR_-m_OR_-c, ...]` and return what they
return, ~7 s of a core sooner per process. Tests use them wherever a process's start is not what they test (a
trainer rank, the fault injector, a rank script, a preflight); the launchers' tests run real interpreters.

A program is forked from the server only when that is indistinguishable from a fresh interpreter: its interpreter is
this one, with no interpreter flags, and its environment differs from the session's only in variables that nothing
imported by the server reads at import (RUN_TIME_VARIABLES). Anything else (a cache's location, HF_HOME,
another interpreter) starts a real process, as subprocess does. DSLM_TEST_FRESH_PROCESSES=1 starts every program as a
real process (to compare the two ways, or to rule this one out).
"""

from __future__ import annotations

import json
import os
import select
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from preloaded_server import HEADER

SERVER = Path(__file__).with_name("preloaded_server.py")
# Read by the trainer, DeepSpeed's launcher code or torch.distributed when a run starts, never at import; OMP_NUM_THREADS
# is read by OpenMP at torch's import, and the child sets it as a fresh process would have it (preloaded_server.become).
# PYTHONPATH is read at the interpreter's start only: the child puts it on sys.path as the interpreter would.
RUN_TIME_VARIABLES = frozenset({
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS",
    "PYTHONUNBUFFERED", "FAULT", "GPU_MEMORY_GIB", "GPU_PEAK_TFLOPS",
    "PYTEST_CURRENT_TEST",
    # set in the session by tests that call the trainer's main() in-process; read when tokenizers or CUDA start
    # or by libraries as tests use them in-process (accelerate's CUDA check, the terminal's size); read at run time
    "TOKENIZERS_PARALLELISM", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "PYTORCH_NVML_BASED_CUDA_CHECK",
    "COLUMNS", "LINES",  # pytest's, set for the test that runs
    "PYTHONPATH"})


class _Server:
    """The session's one server, started on first use with the environment the session began with."""

    def __init__(self):
        self.lock = threading.Lock()
        self.process: subprocess.Popen | None = None
        self.env: dict[str, str] = {}
        self.path = ""

    def ensure_running(self, session_env: dict[str, str]) -> None:
        with self.lock:
            if self.process is not None and self.process.poll() is None:
                return
            self.env = dict(session_env)
            self.path = os.path.join(tempfile.mkdtemp(prefix="dslm-preloaded-"), "server.sock")
            log = open(Path(self.path).with_name("server.log"), "w")
            self.process = subprocess.Popen([sys.executable, str(SERVER), self.path], env=self.env,
                                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True)
            for line in self.process.stdout:  # the libraries' own import-time lines first (DeepSpeed's accelerator)
                if line.strip() == "ready":
                    break
            else:
                raise RuntimeError(f"the preloaded server did not start:\n{Path(log.name).read_text()[-4000:]}")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.stdin.close()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()


SERVER_PROCESS = _Server()
SESSION_ENV: dict[str, str] = {}  # set by conftest once it has made the session's environment


def why_not_forked(args, env=None, kwargs=()) -> str | None:
    """Why `args` with `env` starts a real interpreter, or None where the server forks it."""
    if os.environ.get("DSLM_TEST_FRESH_PROCESSES") == "1":
        return "DSLM_TEST_FRESH_PROCESSES=1"
    if not SESSION_ENV:
        return "no session environment (outside pytest)"
    if len(args) < 2 or str(args[0]) != sys.executable:
        return "another interpreter"
    if str(args[1]).startswith("-") and (str(args[1]) not in ("-c", "-m") or len(args) < 3):
        return f"interpreter flag {args[1]}"
    unsupported = set(kwargs) - {"cwd", "env", "stdin", "stdout", "stderr", "text", "capture_output", "timeout",
                                 "check"}
    if unsupported:
        return f"subprocess options {sorted(unsupported)}"
    env = os.environ if env is None else env
    differing = {k for k in set(env) | set(SESSION_ENV) if env.get(k) != SESSION_ENV.get(k)
                 and k not in RUN_TIME_VARIABLES and not k.startswith(NOT_PRELOADED_PREFIXES)}
    return f"environment read at import differs: {sorted(differing)}" if differing else None


NOT_PRELOADED_PREFIXES = ("WANDB_",)  # libraries the server does not import (wandb sets WANDB_SERVICE in-process)
FRESH_STARTS: dict[str, int] = {}  # why programs started as real processes, and how many: the run's summary lists them


def _forkable(args, env, kwargs) -> bool:
    why = why_not_forked(args, env, kwargs)
    if why is not None:
        FRESH_STARTS[why] = FRESH_STARTS.get(why, 0) + 1
    return why is None


def _stream(value, default_fd: int, text: bool, reading: bool):
    """The file descriptor a child's stream gets, whether it is ours to close, and our end of a pipe (PIPE)."""
    if value is None:
        return default_fd, False, None
    if value == subprocess.DEVNULL:
        return os.open(os.devnull, os.O_RDWR), True, None
    if value == subprocess.PIPE:
        read_end, write_end = os.pipe()
        child_end, ours = (write_end, read_end) if reading else (read_end, write_end)
        return child_end, True, open(ours, ("r" if reading else "w") + ("" if text else "b"))
    if isinstance(value, int):
        return value, False, None
    return value.fileno(), False, None


class PreloadedProcess:
    """A program forked by the server: subprocess.Popen's pid, poll, wait, send_signal, kill, terminate, returncode."""

    def __init__(self, args, cwd=None, env=None, stdin=None, stdout=None, stderr=None, text=False):
        self.args = [str(a) for a in args]
        self.returncode: int | None = None
        out_fd, close_out, self.stdout = _stream(stdout, 1, text, reading=True)
        if stderr == subprocess.STDOUT:
            err_fd, close_err, self.stderr = out_fd, False, None
        else:
            err_fd, close_err, self.stderr = _stream(stderr, 2, text, reading=True)
        in_fd, close_in, self.stdin = _stream(subprocess.DEVNULL if stdin is None else stdin, 0, text, reading=False)
        request = json.dumps({"args": self.args[1:], "cwd": str(cwd or os.getcwd()),
                              "env": dict(os.environ if env is None else env)}).encode()
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(SERVER_PROCESS.path)
        socket.send_fds(self.sock, [HEADER.pack(len(request)) + request], [in_fd, out_fd, err_fd])
        for fd, ours in ((in_fd, close_in), (out_fd, close_out), (err_fd, close_err)):
            if ours:
                os.close(fd)
        self._reader = self.sock.makefile("r")
        self.pid = int(self._reader.readline())

    def poll(self) -> int | None:
        if self.returncode is None and select.select([self.sock], [], [], 0)[0]:
            self._read_status()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if not select.select([self.sock], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self._read_status()
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple:
        """subprocess's: everything the child writes to its pipes, once it has ended."""
        results: dict[str, object] = {}
        readers = [threading.Thread(target=lambda n=name, f=pipe: results.__setitem__(n, f.read()), daemon=True)
                   for name, pipe in (("out", self.stdout), ("err", self.stderr)) if pipe is not None]
        for reader in readers:
            reader.start()
        self.wait(timeout)
        for reader in readers:
            reader.join()
        return results.get("out"), results.get("err")

    def _read_status(self) -> None:
        line = self._reader.readline()
        self.returncode = int(line) if line.strip() else 255  # the server itself died
        self._reader.close()
        self.sock.close()

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        import signal

        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        import signal

        self.send_signal(signal.SIGTERM)


def Popen(args, **kwargs):  # noqa: N802 (subprocess's name)
    """subprocess.Popen(args, **kwargs), forked from the preloaded server where that is indistinguishable."""
    if not _forkable(args, kwargs.get("env"), kwargs) or {"capture_output", "timeout", "check"} & set(kwargs):
        return subprocess.Popen(args, **kwargs)
    SERVER_PROCESS.ensure_running(SESSION_ENV)
    return PreloadedProcess(args, **kwargs)


def run(args, *, cwd=None, env=None, capture_output=False, text=False, timeout=None, check=False, **kwargs):
    """subprocess.run(args, ...), forked from the preloaded server where that is indistinguishable."""
    if not _forkable(args, env, {"cwd": cwd, **kwargs}) or set(kwargs) - {"stdout", "stderr", "stdin"}:
        return subprocess.run(args, cwd=cwd, env=env, capture_output=capture_output, text=text, timeout=timeout,
                              check=check, **kwargs)
    SERVER_PROCESS.ensure_running(SESSION_ENV)
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        streams = {"stdout": out, "stderr": err} if capture_output else {}
        streams.update(kwargs)
        proc = PreloadedProcess(args, cwd=cwd, env=env, **streams)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
        captured = []
        for f in (out, err):
            f.seek(0)
            data = f.read() if capture_output else None
            if text and data is not None:  # as subprocess's text mode reads it: universal newlines
                data = data.decode(errors="replace").replace("\r\n", "\n").replace("\r", "\n")
            captured.append(data)
    done = subprocess.CompletedProcess(proc.args, proc.returncode, *captured)
    if check:
        done.check_returncode()
    return done


def stop() -> None:
    """End the server (children still running finish on their own, as subprocess's would)."""
    SERVER_PROCESS.stop()
