"""Progress of a data preparation, shown to its own terminal or log and shared through a file with the processes that
wait for it.

The preparer writes a small JSON progress file (documents, tokens, rate, ETA, host, pid, a heartbeat counter) and,
if it stops on a problem, a failure file holding that problem. A waiting process polls the finished marker, the
failure file and the progress file: it prints the preparer's progress, raises the preparer's problem, and stops with
a clear message when the heartbeat stops advancing (the preparer died or hangs). No collective operation with a
timeout is involved, so a preparation may take as long as the corpus needs.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from pathlib import Path

from model_utils.core.problems import Problem
from model_utils.runtime.run_lock import pid_alive

HEARTBEAT_SECONDS = 10.0  # how often a live preparer's progress file changes, even inside one long batch
LOG_LINE_SECONDS = 30.0  # how often a progress line goes to a log file (not a terminal) or a waiting rank's output
POLL_SECONDS = 2.0


class PreparationFailed(Exception):
    """The preparer stopped on a problem, or stopped reporting: `problem` says which and what to do."""

    def __init__(self, problem: Problem, lost: bool = False):
        self.problem = problem
        self.lost = lost  # the preparer died, hangs or never reported (else it recorded the problem itself)
        super().__init__(str(problem))


def write_json_atomic(path: Path, content: dict) -> None:
    """Write `content` to a temporary name and rename it: a reader sees the old file or the new one, never half."""
    tmp = path.with_name(f"{path.name}.tmp-{socket.gethostname()}-{os.getpid()}")
    tmp.write_text(json.dumps(content, indent=1))
    os.replace(tmp, path)


def read_json(path: Path) -> dict | None:
    """The file's JSON object, or None when it does not exist (yet) or is being replaced."""
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def format_count(n: float) -> str:
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return f"{n:.0f}"


def format_duration(seconds: float | None) -> str:
    if seconds is None or seconds != seconds or seconds == float("inf"):
        return "?"
    seconds = int(seconds)
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    if seconds >= 60:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds}s"


def describe(state: dict) -> str:
    """One line: documents, tokens, token rate, share of the input done and the time left."""
    parts = [f"{state.get('documents', 0):,} documents", f"{format_count(state.get('tokens', 0))} tokens",
             f"{format_count(state.get('tokens_per_second', 0))} tokens/s"]
    if state.get("fraction") is not None:
        parts.append(f"{100 * state['fraction']:.1f}% of the input")
        parts.append(f"ETA {format_duration(state.get('eta_seconds'))}")
    return ", ".join(parts)


class Progress:
    """Counts of one preparation: shown as a tqdm bar on a terminal, as a plain line every LOG_LINE_SECONDS otherwise
    (no carriage-return bars in log files), and written to `path` for waiting processes. `total_units`: the input's
    size in the units passed to update (bytes or rows), for the share done and the ETA; None when unknown.
    A heartbeat thread rewrites the file every HEARTBEAT_SECONDS so that waiters can tell a slow batch from a dead
    preparer. Use as a context manager; `fail(problem)` records a problem for the waiters."""

    def __init__(self, path: Path | None, label: str, total_units: float | None = None, claim: str = "",
                 stream=None, line_seconds: float = LOG_LINE_SECONDS, heartbeat_seconds: float = HEARTBEAT_SECONDS):
        self.path, self.label, self.total_units, self.claim = path, label, total_units, claim
        self.stream = stream or sys.stderr
        self.line_seconds, self.heartbeat_seconds = line_seconds, heartbeat_seconds
        self.documents = self.tokens = self.start_tokens = 0
        self.units = 0.0
        self.start_units = 0.0
        self.started = time.monotonic()
        self.last_line = self.started
        self.beat = 0
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        self.bar = None
        if self.stream.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total_units, desc=label, unit="B" if total_units else "doc", unit_scale=True,
                            file=self.stream, dynamic_ncols=True)
        self.thread = threading.Thread(target=self._heartbeat, name="data-progress-heartbeat", daemon=True)

    def __enter__(self):
        self._write("running")
        self.thread.start()
        return self

    def __exit__(self, kind, error, trace):
        self.stopped.set()
        self.thread.join()
        if self.bar is not None:
            self.bar.close()
        if error is None:
            self._write("done")
            print(f"{self.label}: done, {describe(self.state())} in {format_duration(self.elapsed())}",
                  file=self.stream, flush=True)
        return False

    def set_total(self, units: float) -> None:
        """The input's size, once it is known (for the share done and the ETA)."""
        self.total_units = units
        if self.bar is not None:
            self.bar.total = units
            self.bar.refresh()

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def resume_from(self, documents: int, tokens: int, units: float) -> None:
        """Work finished by an earlier attempt: counted in the totals, not in the rate."""
        self.documents, self.tokens, self.units = documents, tokens, units
        self.start_tokens, self.start_units = tokens, units
        if self.bar is not None:
            self.bar.update(units if self.total_units else documents)

    def update(self, documents: int, tokens: int, units: float) -> None:
        """Add work just done."""
        with self.lock:
            self.documents += documents
            self.tokens += tokens
            self.units += units
        if self.bar is not None:
            self.bar.update(units if self.total_units else documents)
            self.bar.set_postfix_str(f"{format_count(self.tokens)} tokens", refresh=False)
        now = time.monotonic()
        if self.bar is None and now - self.last_line >= self.line_seconds:
            self.last_line = now
            print(f"{self.label}: {describe(self.state())}", file=self.stream, flush=True)

    def state(self) -> dict:
        with self.lock:
            elapsed = max(self.elapsed(), 1e-9)
            new_tokens = self.tokens - self.start_tokens
            unit_rate = (self.units - self.start_units) / elapsed
            fraction = min(1.0, self.units / self.total_units) if self.total_units else None
            eta = ((self.total_units - self.units) / unit_rate if unit_rate > 0 else None) if self.total_units else None
            return {"claim": self.claim, "label": self.label, "documents": self.documents, "tokens": self.tokens,
                    "tokens_per_second": new_tokens / elapsed, "fraction": fraction, "eta_seconds": eta,
                    "elapsed_seconds": elapsed, "host": socket.gethostname(), "pid": os.getpid(), "beat": self.beat,
                    "updated": time.time()}

    def _write(self, status: str) -> None:
        if self.path is not None:
            write_json_atomic(self.path, {**self.state(), "status": status})

    def _heartbeat(self) -> None:
        while not self.stopped.wait(self.heartbeat_seconds):
            self.beat += 1
            self._write("running")

    def tick(self) -> None:
        """Write the progress file now (the heartbeat writes it anyway)."""
        self.beat += 1
        self._write("running")


def record_failure(path: Path, problem: Problem, claim: str = "") -> None:
    """Leave `problem` where waiting processes look for it."""
    write_json_atomic(path, {"claim": claim, "setting": problem.setting, "value": problem.value,
                             "message": problem.message, "fix": problem.fix, "host": socket.gethostname(),
                             "pid": os.getpid()})


def wait_for_preparer(finished: Path, progress: Path, failure: Path, claim: str, what: str, stale_seconds: float,
                      log=print, quiet: bool = False, poll_seconds: float = POLL_SECONDS,
                      line_seconds: float = LOG_LINE_SECONDS) -> None:
    """Return once `finished` exists. Raise PreparationFailed with the preparer's problem when `failure` holds one
    for `claim`; or with a problem naming the progress file when the preparer of `claim` stops advancing its heartbeat
    for `stale_seconds`, its process is gone (same host), or no preparer reports within `stale_seconds`. Prints the
    preparer's progress every `line_seconds` unless `quiet`."""
    started = last_change = time.monotonic()
    last_beat, last_line = None, started
    while not finished.exists():
        failed = read_json(failure)
        if failed is not None and failed.get("claim") == claim:
            raise PreparationFailed(Problem(failed["setting"], failed["value"],
                                            f"{failed['message']} (found by the preparing process on "
                                            f"{failed.get('host')}, pid {failed.get('pid')})", failed["fix"]))
        state = read_json(progress)
        now = time.monotonic()
        if state is not None and state.get("claim") == claim:
            beat = (state.get("beat"), state.get("documents"), state.get("status"))
            if beat != last_beat:
                last_beat, last_change = beat, now
            if state.get("host") == socket.gethostname() and not pid_alive(int(state.get("pid", 0))):
                if finished.exists():
                    return
                raise PreparationFailed(_stopped(what, progress, state, "exited without finishing"), lost=True)
            if now - last_change > stale_seconds:
                raise PreparationFailed(_stopped(what, progress, state,
                                                 f"has not updated its progress for {now - last_change:.0f} s"),
                                        lost=True)
            if not quiet and now - last_line >= line_seconds:
                last_line = now
                print_waiting(log, what, state, now - started)
        elif now - started > stale_seconds:
            raise PreparationFailed(Problem(
                "--data_stale_minutes", round(stale_seconds / 60, 2),
                f"no process reported preparing {what} within {stale_seconds:.0f} s (expected progress in {progress})",
                "check the log of the rank that prepares the data (global rank 0, or each node's first rank where "
                "the cache directory is node-local); raise --data_stale_minutes if its start is slow"), lost=True)
        time.sleep(poll_seconds)


def print_waiting(log, what: str, state: dict, waited: float) -> None:
    log(f"data: waiting {format_duration(waited)} for {what} (prepared by {state.get('host')} pid {state.get('pid')}): "
        f"{describe(state)}")


def _stopped(what: str, progress: Path, state: dict, how: str) -> Problem:
    return Problem("--data_stale_minutes" if "updated" in how else "--dataset", str(progress),
                   f"the process preparing {what} ({state.get('host')} pid {state.get('pid')}) {how}, at "
                   f"{describe(state)}",
                   "read that process's log for the cause, then run again: a finished token cache is reused"
                   + (" (raise --data_stale_minutes if it is only slow)" if "updated" in how else ""))
