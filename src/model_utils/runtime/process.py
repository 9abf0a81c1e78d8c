"""What each rank sets up in its own process: its share of the host's cores, how it pins host memory, its seeds and
random state (saved per rank in every checkpoint, so a resumed run draws the same numbers), and the signals that ask
it to stop (SLURM's warning signal USR1, the time limit's TERM, Ctrl-C)."""

from __future__ import annotations

import os
import random
import signal

import numpy as np
import torch


def host_threads(environ, cpus_in_mask: int, cpus_on_node: int, torch_default: int) -> tuple[int | None, str]:
    """This rank's share of the host's cores for torch's (and DeepSpeedCPUAdam's) OpenMP threads: the count to set,
    or None to keep torch's own, and why. Torch sizes its threads to the cores of the process's CPU mask, so ranks
    started side by side without a mask of their own (run_local_ranks, srun without CPU binding) each take every
    core: the ranks' CPU optimizer steps then run oversubscribed, one thread per core per rank (DeepSpeed's launcher
    binds cores per rank for that reason, its PR 7474). OMP_NUM_THREADS, when set, is the user's."""
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


# PyTorch's pinned host memory mapped by 8 threads and registered with CUDA, not cudaHostAlloc on one thread: a first
# background save allocates its host buffers while training stands still, and this way pins them in a third of the
# time (benchmarks/save_stall.py; docs/PERFORMANCE.md, Checkpoint saves). DeepSpeed's pinned offload buffers too.
PINNED_MEMORY_SETTINGS = "pinned_use_cuda_host_register:True,pinned_num_register_threads:8"


def pin_host_memory_by_threads(environ=os.environ) -> None:
    """Add PINNED_MEMORY_SETTINGS to PyTorch's allocator settings (PYTORCH_ALLOC_CONF where the user set it, else
    PYTORCH_CUDA_ALLOC_CONF), before CUDA starts in this process; settings of pinned memory the user gave stay."""
    key = _allocator_settings_key(environ)
    value = environ.get(key, "")
    if "pinned_use_cuda_host_register" not in value:
        environ[key] = ",".join(x for x in (value, PINNED_MEMORY_SETTINGS) if x)


def pinned_memory_line(environ=os.environ) -> str:
    """How this process pins host memory, for the run's header."""
    key = _allocator_settings_key(environ)
    if PINNED_MEMORY_SETTINGS in environ.get(key, ""):
        return f"pinned host memory: pages mapped by 8 threads, then registered with CUDA ({key} overrides)"
    return f"pinned host memory: as {key} sets it"


def _allocator_settings_key(environ) -> str:
    return "PYTORCH_ALLOC_CONF" if environ.get("PYTORCH_ALLOC_CONF") else "PYTORCH_CUDA_ALLOC_CONF"


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
