"""The run's log: rank 0 prints and appends CHECKPOINT_DIR/metrics.jsonl, other ranks print their warnings; the
throughput and memory figures of each log line."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

from model_utils.runtime.distributed import Dist


class Logger:
    """Rank 0 prints; other ranks print only warnings, prefixed with their rank. Rank 0 appends metrics.jsonl."""

    def __init__(self, dist: Dist, metrics_path: Path | None):
        self.dist = dist
        self.metrics_path = metrics_path
        self.bar = None
        self.sinks = None  # runtime.monitor.Sinks (TensorBoard, W&B): set once the engine exists
        self.metrics_failed = False  # the last append to metrics.jsonl failed (warned once per failing stretch)
        self.start_time = time.time()

    def info(self, msg: str):
        if not self.dist.is_main:
            return
        if self.bar is not None:
            self.bar.write(msg)  # keeps the progress bar at the bottom
        else:
            print(msg, flush=True)

    def warn(self, msg: str, all_ranks: bool = False):
        if self.dist.is_main or all_ranks:
            prefix = f"[rank {self.dist.rank}] " if self.dist.world_size > 1 else ""
            print(f"{prefix}warning: {msg}", file=sys.stderr, flush=True)

    def metrics(self, record: dict):
        if self.dist.is_main and self.metrics_path is not None:
            try:
                self.metrics_path.parent.mkdir(parents=True, exist_ok=True)
                with open(self.metrics_path, "a", encoding="utf-8") as f:
                    f.write(json.dumps(record) + "\n")
            except OSError as e:  # a full or vanished filesystem: training goes on, the next save names the cause
                if not self.metrics_failed:
                    self.warn(f"{self.metrics_path} could not be appended ({e.strerror or e}); its records are "
                              f"missing from step {record.get('step', '?')} on while this lasts (the log still has "
                              "them)")
                self.metrics_failed = True
            else:
                self.metrics_failed = False
            if self.sinks is not None:
                self.sinks.write(record)


class Throughput:
    """Tokens/s, TFLOP/s per device and MFU over the interval since the last read."""

    def __init__(self, peak_tflops: float | None, world_size: int):
        self.peak = peak_tflops
        self.world = world_size
        self.t0 = time.perf_counter()

    def read(self, tokens: float, flops: float) -> dict:
        """`tokens` and `flops`: what all ranks processed since the last read."""
        now = time.perf_counter()
        dt = max(now - self.t0, 1e-9)
        self.t0 = now
        tps = tokens / dt
        tflops = flops / dt / self.world / 1e12
        out = {"tokens_per_s": tps, "tokens_per_s_per_device": tps / self.world, "tflops_per_device": tflops}
        if self.peak:
            out["mfu"] = tflops / self.peak
        return out


def host_memory_gib() -> tuple[float | None, float | None]:
    """This process's resident memory now and at its peak (Linux; None elsewhere). No device synchronisation."""
    try:
        import resource

        with open("/proc/self/statm") as f:
            current = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux; the kernel updates it lazily
        return current / 1024**3, max(peak, current) / 1024**3
    except (OSError, ImportError, ValueError, IndexError):
        return None, None


def memory_stats(device: torch.device) -> dict:
    gib = 1024**3
    out = {}
    if device.type == "cuda":
        out = {"mem_gib": torch.cuda.memory_allocated(device) / gib,
               "peak_mem_gib": torch.cuda.max_memory_allocated(device) / gib}
    current, peak = host_memory_gib()
    if current is not None:
        out.update(host_mem_gib=current, host_peak_mem_gib=peak)
    return out


def bars_only_on_a_terminal() -> None:
    """The libraries' progress bars (transformers' shard writes, datasets' maps) off where stderr is not a terminal:
    in a job's log file each redraw would be another line of carriage returns; the run's own log lines say the same."""
    if sys.stderr.isatty():
        return
    import datasets
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    datasets.disable_progress_bars()
