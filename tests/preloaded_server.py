"""A Python process that imports the trainer's libraries once and forks a program from itself on request, for the
tests (tests/preloaded.py is its client; nothing of the product uses it).

    python tests/preloaded_server.py SOCKET

A fresh `python src/train_deepspeed.py` spends ~7 s of a core importing torch, deepspeed, transformers, datasets and
peft before its first line runs; a test suite that starts ~300 such processes spends half its time there. Here they
are imported once, then for each request (the program's argv, working directory, environment and its three standard
streams, sent as file descriptors over the socket) the server forks, and the child becomes the program as a fresh
interpreter would run it: `sys.argv`, `sys.path[0]`, the environment and the working directory set, the streams on
fds 0-2, the program run as `__main__`, and the interpreter's own exit (threads joined, atexit, flushes) with its
status. The server answers the child's pid, then its exit status as subprocess reports it (negative: the signal).

Only what the libraries read when they are imported can differ from a fresh process: the client (tests/preloaded.py)
therefore forks only when the environment differs from the server's in variables read at run time (the rank's, the
fault injector's), and starts a real interpreter otherwise. The libraries are imported with no thread pool started
(no tensor operation runs here), so a child's OpenMP and gloo threads start fresh.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import struct
import sys

HEADER = struct.Struct("!I")  # the request's length in bytes; the request is JSON
SERVER_PYTHONPATH = set(filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep)))


# What every trainer rank imports at its start. Import only: no tensor is created here. A module that a version in
# the allowed range lacks is left to the program to import (or fail on) itself.
PRELOADED = ("torch", "torch.distributed", "torch.utils.cpp_extension", "torch.utils.tensorboard", "deepspeed",
             "deepspeed.runtime.engine", "transformers", "transformers.modeling_utils", "transformers.masking_utils",
             "transformers.modeling_layers", "transformers.models.qwen3.modeling_qwen3",
             "transformers.models.llama.modeling_llama", "datasets", "peft",
             # imported by deepspeed.initialize and a checkpoint's save (DeepSpeed 0.19)
             "deepspeed.runtime.zero.muon.muon_optimizer", "deepspeed.module_inject.auto_ep_config",
             "torch.utils.serialization")


def preload() -> None:
    import importlib

    for name in PRELOADED:
        try:
            importlib.import_module(name)
        except ImportError:
            pass


def receive(conn: socket.socket) -> tuple[dict, list[int]]:
    data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
    while len(data) < HEADER.size:
        data += conn.recv(1 << 16)
    (length,) = HEADER.unpack_from(data)
    data = data[HEADER.size:]
    while len(data) < length:
        chunk = conn.recv(1 << 16)
        if not chunk:
            raise EOFError("request cut short")
        data += chunk
    return json.loads(data), fds


def become(request: dict, streams: list[int]) -> None:
    """In the forked child: the program of `request`, as `python ARGS` would run it; exits with its status."""
    import runpy

    for target, fd in enumerate(streams):
        os.dup2(fd, target)
        os.close(fd)
    for stream in (sys.stdout, sys.stderr):  # PYTHONUNBUFFERED, as the tests' rank environments ask
        stream.reconfigure(line_buffering=True, write_through=True)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    if "OMP_NUM_THREADS" in os.environ:  # read by OpenMP when torch loaded, here: set as a fresh process would have it
        import torch

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    # A fresh interpreter's path: the program's folder, PYTHONPATH, then the installation's (the server's own, less its
    # folder); the server started without PYTHONPATH (the client forks only where the session had none or the same).
    base_path = [*filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep)),
                 *(p for p in sys.path[1:] if p and p not in SERVER_PYTHONPATH)]
    args = request["args"]
    if args[0] == "-c":
        sys.argv = ["-c", *args[2:]]
        sys.path[:] = ["", *base_path]
        exec(compile(args[1], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    elif args[0] == "-m":
        sys.argv = [args[1], *args[2:]]
        sys.path[:] = [os.getcwd(), *base_path]
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    else:
        script = os.path.abspath(args[0])
        sys.argv = list(args)
        sys.path[:] = [os.path.dirname(script), *base_path]
        runpy.run_path(script, run_name="__main__")
    sys.exit(0)


def main(path: str) -> None:
    preload()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so that the wakeup fd hears of each child's end
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # ^C in the test's terminal is for pytest
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    selector.register(wake_r, selectors.EVENT_READ)
    selector.register(sys.stdin, selectors.EVENT_READ)  # the client holds it open: EOF when it is gone
    children: dict[int, socket.socket] = {}
    print("ready", flush=True)
    while True:
        for key, _ in selector.select():
            if key.fileobj is listener:
                conn, _ = listener.accept()
                request, streams = receive(conn)
                pid = os.fork()
                if pid == 0:
                    signal.set_wakeup_fd(-1)
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    signal.signal(signal.SIGINT, signal.default_int_handler)
                    selector.close()
                    for fd in (wake_r, wake_w):
                        os.close(fd)
                    for other in (listener, conn, *children.values()):
                        other.close()
                    become(request, streams)
                for fd in streams:
                    os.close(fd)
                children[pid] = conn
                conn.sendall(f"{pid}\n".encode())
            elif key.fileobj == wake_r:
                os.read(wake_r, 4096)
                while children:
                    try:
                        pid, status = os.waitpid(-1, os.WNOHANG)
                    except ChildProcessError:
                        break
                    if pid == 0:
                        break
                    conn = children.pop(pid, None)
                    if conn is not None:
                        try:
                            conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
                        except OSError:  # the client has gone: nobody waits for this status
                            pass
                        conn.close()
            elif not os.read(sys.stdin.fileno(), 4096):  # the client (the test session) has ended
                os.unlink(path)
                return


if __name__ == "__main__":
    main(sys.argv[1])
