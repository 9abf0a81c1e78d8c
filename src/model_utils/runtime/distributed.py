"""The process group: the environment a launcher gives each rank, the backend for its device, and the collectives
the run uses (all of them through `Dist`)."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch

from model_utils.core import cuda_arch
from model_utils.core.problems import Problem


@dataclass
class Dist:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    backend: str
    sequence_parallel: int = 1  # GPUs that share each sequence (--sequence_parallel): consecutive ranks, one group

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def data_rank(self) -> int:
        """This rank's place among the data-parallel ranks: the ranks of one sequence-parallel group read the same
        blocks (each its own slice of their sequences)."""
        return self.rank // self.sequence_parallel

    @property
    def data_world(self) -> int:
        """The data-parallel ranks: groups of --sequence_parallel GPUs, each reading its own blocks."""
        return self.world_size // self.sequence_parallel

    @property
    def sequence_rank(self) -> int:
        """This rank's slice of each sequence within its sequence-parallel group (0 without sequence parallelism)."""
        return self.rank % self.sequence_parallel

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
    if env.get("GPU_MEMORY_GIB") and gpu_memory_override() is None:
        return [Problem("GPU_MEMORY_GIB", env["GPU_MEMORY_GIB"], "is not a positive number of GiB",
                        "give one GPU's memory in GiB (GPU_MEMORY_GIB=79.2 for an 80 GB H100), or unset it")]
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
    """TORCH_CUDA_ARCH_LIST in this process's environment as DeepSpeed's op builder can read it
    (core.cuda_arch.normalize; ValueError for a malformed entry, which distributed_env_problems reports first)."""
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
        cap_gpu_memory(local_rank)
        device, backend = torch.device("cuda", local_rank), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    deepspeed.init_distributed(dist_backend=backend, timeout=timedelta(minutes=timeout_minutes))
    return Dist(rank, local_rank, world, device, backend)


def gpu_memory_override() -> float | None:
    """GPU_MEMORY_GIB as a number of GiB, None where it is unset or not a positive number (distributed_env_problems
    stops a run on the latter before anything plans)."""
    try:
        value = float(os.environ.get("GPU_MEMORY_GIB") or "nan")
    except ValueError:
        return None
    return value if value > 0 else None


def cap_gpu_memory(device: int) -> float | None:
    """Hold PyTorch's allocator on this GPU to GPU_MEMORY_GIB where that is less than the GPU has, the size the plan
    sized everything for (planning.plan.gpu_memory_gib): a step that would not fit the smaller GPU runs out of memory
    here as it would there. The fraction given, or None where nothing is capped."""
    override = gpu_memory_override()
    total = torch.cuda.get_device_properties(device).total_memory
    if override is None or override * 2**30 >= total:
        return None
    fraction = override * 2**30 / total
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    return fraction


def bf16_supported() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
