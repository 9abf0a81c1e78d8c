"""Training utilities: distributed setup, seeding and RNG state, stop signals, logging and metrics."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch

from . import cuda_arch
from .arguments import Problem


# --------------------------------------------------------------------------------------------------------------------
# Distributed
# --------------------------------------------------------------------------------------------------------------------
@dataclass
class Dist:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self):
        if torch.distributed.is_initialized():
            if self.backend == "nccl":
                torch.distributed.barrier(device_ids=[self.local_rank])
            else:
                torch.distributed.barrier()

    def broadcast_object(self, obj):
        if not torch.distributed.is_initialized() or self.world_size == 1:
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]

    def all_gather_object(self, obj) -> list:
        if not torch.distributed.is_initialized() or self.world_size == 1:
            return [obj]
        gathered = [None] * self.world_size
        torch.distributed.all_gather_object(gathered, obj)
        return gathered

    def all_reduce(self, tensor: torch.Tensor, op=None) -> torch.Tensor:
        if torch.distributed.is_initialized() and self.world_size > 1:
            torch.distributed.all_reduce(tensor, op=op or torch.distributed.ReduceOp.SUM)
        return tensor


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def distributed_env_problems() -> list[Problem]:
    """Map SLURM's per-task variables onto torch's (srun with one task per GPU), or fill a single-process world; a
    TORCH_CUDA_ARCH_LIST that DeepSpeed could not build for is a problem too."""
    env = os.environ
    try:
        cuda_arch.normalize(env.get("TORCH_CUDA_ARCH_LIST", ""))
    except ValueError as e:
        return [Problem("TORCH_CUDA_ARCH_LIST", env["TORCH_CUDA_ARCH_LIST"], str(e).split(": fix")[0],
                        "list architectures such as 8.0;9.0 (9.0a and +PTX are accepted), or unset it")]
    if "RANK" not in env and "SLURM_STEP_ID" in env and int(env.get("SLURM_NTASKS", "1")) > 1:
        env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"] = env["SLURM_PROCID"], env["SLURM_LOCALID"], env["SLURM_NTASKS"]
        env.setdefault("LOCAL_WORLD_SIZE", env.get("SLURM_NTASKS_PER_NODE", "1"))  # the ranks sharing this node's cores
        if "MASTER_ADDR" not in env:
            return [Problem("MASTER_ADDR", None, "is unset in a multi-task srun step",
                            'export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1) before srun '
                            "(the project's launchers do this)")]
        env.setdefault("MASTER_PORT", "29500")
    if "RANK" not in env:
        env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    env.setdefault("LOCAL_RANK", "0")
    return []


def normalize_cuda_arch_list() -> str | None:
    """TORCH_CUDA_ARCH_LIST in this process's environment as DeepSpeed's op builder can read it (cuda_arch.normalize;
    ValueError for a malformed entry, which distributed_env_problems reports first)."""
    value = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if not value:
        return value
    os.environ["TORCH_CUDA_ARCH_LIST"] = cuda_arch.normalize(value)
    return os.environ["TORCH_CUDA_ARCH_LIST"]


def setup_distributed(timeout_minutes: int = 30) -> Dist:
    normalize_cuda_arch_list()  # before DeepSpeed builds any op (fused/CPU Adam), whatever launched this process
    import deepspeed

    rank, local_rank, world = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device, backend = torch.device("cuda", local_rank), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    deepspeed.init_distributed(dist_backend=backend, timeout=timedelta(minutes=timeout_minutes))
    return Dist(rank, local_rank, world, device, backend)


def host_threads(environ, cpus_in_mask: int, cpus_on_node: int, torch_default: int) -> tuple[int | None, str]:
    """This rank's share of the host's cores for torch's (and DeepSpeedCPUAdam's) OpenMP threads: the count to set,
    or None to keep torch's own, and why. Torch sizes its threads to the cores of the process's CPU mask, so ranks
    started side by side without a mask of their own (run_local_ranks, srun without CPU binding) each take every
    core: eight ranks' CPU optimizer steps then run 8x oversubscribed (DeepSpeed's launcher binds cores per rank for
    that reason: its PR 7474 measured a 1.3x faster ZeRO-Offload step on two GPUs with it). OMP_NUM_THREADS, when set,
    is the user's."""
    ranks = int(environ.get("LOCAL_WORLD_SIZE") or 1)
    if environ.get("OMP_NUM_THREADS"):
        return None, f"OMP_NUM_THREADS={environ['OMP_NUM_THREADS']}"
    if ranks <= 1 or cpus_in_mask < cpus_on_node:
        mask = "" if cpus_in_mask == cpus_on_node else f" of this rank's {cpus_in_mask} CPUs"
        return None, f"torch's default{mask}; OMP_NUM_THREADS overrides"
    return max(1, torch_default // ranks), (f"torch's {torch_default} for this node's cores, shared by its {ranks} "
                                            "ranks; OMP_NUM_THREADS overrides")


def share_host_cores() -> str:
    """Set this rank's intra-op threads by host_threads; returns the line for the run's header."""
    threads, why = host_threads(os.environ, len(os.sched_getaffinity(0)), os.cpu_count() or 1, torch.get_num_threads())
    if threads is not None:
        torch.set_num_threads(threads)
    return f"host threads: {torch.get_num_threads()} per rank ({why})"


def bf16_supported() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_bf16_supported()


# --------------------------------------------------------------------------------------------------------------------
# Seeds and RNG state (saved per rank in every checkpoint, so a resumed run draws the same numbers)
# --------------------------------------------------------------------------------------------------------------------
def seed_everything(seed: int):
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict):
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


# --------------------------------------------------------------------------------------------------------------------
# Stop signals: SLURM's warning signal (USR1), the time limit (TERM), Ctrl-C (INT)
# --------------------------------------------------------------------------------------------------------------------
class StopSignal:
    """Remember that a stop was asked for; the loop saves and exits at the next step boundary, all ranks together."""

    SIGNALS = ("SIGUSR1", "SIGTERM", "SIGINT")

    def __init__(self):
        self.received: str | None = None
        for name in self.SIGNALS:
            if hasattr(signal, name):
                signal.signal(getattr(signal, name), self._handle)

    def _handle(self, signum, frame):
        if self.received == "SIGINT" and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C means "now"
        self.received = signal.Signals(signum).name


# --------------------------------------------------------------------------------------------------------------------
# Logging and metrics
# --------------------------------------------------------------------------------------------------------------------
class Logger:
    """Rank 0 prints; other ranks print only warnings, prefixed with their rank. Rank 0 appends metrics.jsonl."""

    def __init__(self, dist: Dist, metrics_path: Path | None):
        self.dist = dist
        self.metrics_path = metrics_path
        self.bar = None
        self.sinks = None  # monitor.Sinks (TensorBoard, W&B): set once the engine exists
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
