"""One run per checkpoint directory: a lock file that works on the shared filesystems clusters use.

`CHECKPOINT_DIR/run.lock` is created with O_CREAT|O_EXCL (atomic on local disks, NFS v3+, Lustre, FSx) by rank 0 and
holds who has it: SLURM job id, host, pid, start time. Rank 0 touches it every `HEARTBEAT_S` seconds. A second run
refuses at once, naming the holder, unless:
  - the holder is dead: the same host and its pid is gone (kill -9, a crash), or its heartbeat is older than
    `STALE_S` (a node that died, wherever it was);
  - it is the same SLURM job (a requeued job taking its own lock back);
  - `--force_unlock` says the holder is gone.
flock is not used: on several cluster filesystems it is local to a node or not supported at all.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from model_utils.core.problems import Problem
from model_utils.core.run_dir import RunDir

HEARTBEAT_S = 30.0
STALE_S = 300.0  # ten heartbeats missed


def holder_identity() -> dict:
    return {"job_id": os.environ.get("SLURM_JOB_ID"), "host": socket.gethostname(), "pid": os.getpid(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "token": f"{socket.gethostname()}-{os.getpid()}-{time.time_ns()}"}


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def why_takeable(holder: dict, age_s: float, force: bool) -> str | None:
    """Why a lock held by `holder` (heartbeat `age_s` seconds ago) may be taken over, or None when it may not."""
    here = holder_identity()
    if force:
        return "--force_unlock"
    if holder.get("job_id") and holder.get("job_id") == here["job_id"]:
        return f"the same SLURM job {here['job_id']} (requeued)"
    if holder.get("host") == here["host"] and isinstance(holder.get("pid"), int) and not pid_alive(holder["pid"]):
        return f"its process {holder['pid']} on this host is gone"
    if age_s > STALE_S:
        return f"its heartbeat stopped {age_s:.0f} s ago"
    return None


@dataclass
class RunLock:
    path: Path
    token: str
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start_heartbeat(self) -> None:
        def beat():
            while not self._stop.wait(HEARTBEAT_S):
                try:
                    os.utime(self.path)
                except OSError:
                    return  # removed by a --force_unlock elsewhere: nothing left to keep alive

        self._thread = threading.Thread(target=beat, name="run-lock-heartbeat", daemon=True)
        self._thread.start()

    def release(self) -> None:
        self._stop.set()
        try:
            if json.loads(self.path.read_text()).get("token") == self.token:  # still ours
                self.path.unlink()
        except (OSError, ValueError):
            pass


def acquire(checkpoint_dir: str, force: bool, log) -> tuple[RunLock | None, Problem | None]:
    """Take the lock (rank 0). Returns the lock, or the Problem that names its holder and the way out."""
    path = RunDir.of(checkpoint_dir).lock
    path.parent.mkdir(parents=True, exist_ok=True)
    me = holder_identity()
    for _ in range(3):  # a stale lock removed by us can be raced by another starter: try again
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            try:
                holder, age = json.loads(path.read_text()), time.time() - path.stat().st_mtime
            except FileNotFoundError:
                continue  # released meanwhile
            except (OSError, ValueError):
                holder, age = {}, time.time() - path.stat().st_mtime  # half-written: judge by its age
            reason = why_takeable(holder, age, force)
            if reason is None:
                who = (f"SLURM job {holder['job_id']}, " if holder.get("job_id") else "") + \
                      f"host {holder.get('host', '?')}, pid {holder.get('pid', '?')}"
                return None, Problem(
                    "--checkpoint_dir", checkpoint_dir,
                    f"is in use by another run ({who}, started {holder.get('started', '?')}; its heartbeat "
                    f"{age:.0f} s ago): two runs would overwrite each other's checkpoints and metrics",
                    "wait for it to finish, use another --checkpoint_dir, or, if that run is dead, pass --force_unlock "
                    f"(a lock whose heartbeat is older than {STALE_S:.0f} s is taken over by itself)")
            log(f"run lock: taking over {path} from {holder.get('host', '?')} pid {holder.get('pid', '?')} "
                f"({reason})")
            path.unlink(missing_ok=True)
            continue
        with os.fdopen(fd, "w") as f:
            json.dump(me, f)
            f.flush()
            os.fsync(f.fileno())
        lock = RunLock(path, me["token"])
        lock.start_heartbeat()
        return lock, None
    return None, Problem("--checkpoint_dir", checkpoint_dir, "its run lock kept changing hands while this run started",
                         "another run is starting on the same directory: let one of them run")
