"""What the benchmark's modules share: the project's package (model_utils, installed or from src/), the repository root the
workers run in, the environment every process sets up, the job's DeepSpeed config, and CUDA synchronisation and peak
memory for the two workers' timings."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "src"
# The package of this checkout, ahead of any installed one (the GPU image has none; a venv may hold another
# checkout's editable install): the benchmark measures the code beside it.
if (SRC / "model_utils").is_dir() or importlib.util.find_spec("model_utils") is None:
    sys.path.insert(0, str(SRC))

GIB = 1024**3


def normalize_env():
    """What every benchmark process sets up first: TORCH_CUDA_ARCH_LIST in the form DeepSpeed's op builder parses, as
    the trainer normalises it, and TOKENIZERS_PARALLELISM off unless it is set."""
    from model_utils.runtime.distributed import normalize_cuda_arch_list

    normalize_cuda_arch_list()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def ds_config_for(job: dict, path_out: Path) -> Path:
    """The job's DeepSpeed config, written to `path_out`: the named file, with an optional ZeRO stage override and
    the --ds-set values."""
    from model_utils.config.settings import TrainConfig

    src = TrainConfig.from_flags(ds_config=job.get("ds_config", "ds_config.json")).optim.ds_config_path
    raw = json.loads(src.read_text())
    if job.get("zero_stage") is not None:
        stage = int(job["zero_stage"])
        zero = raw.setdefault("zero_optimization", {})
        zero["stage"] = stage
        if stage < 2:
            for key in ("overlap_comm", "contiguous_gradients", "reduce_scatter", "allgather_bucket_size"):
                zero.pop(key, None)
        if stage == 0:
            raw["zero_optimization"] = {"stage": 0}
    for setting in job.get("ds_set", []):  # dotted.key=JSON value, e.g. zero_optimization.overlap_comm=false
        key, _, value = setting.partition("=")
        *parents, leaf = key.split(".")
        node = raw
        for name in parents:
            node = node.setdefault(name, {})
        node[leaf] = json.loads(value)
    path_out.write_text(json.dumps(raw, indent=2))
    return path_out


def cuda_sync():
    """Wait until the GPU is done (nothing on CPU): a timed step ends when its kernels have run."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def host_peak_gib() -> float:
    """This process's peak resident host memory in GiB (pinned buffers and offloaded optimizer states included)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB  # Linux reports KiB


def peak_memory() -> dict:
    """This process's peak allocated and reserved CUDA memory in GiB; empty on CPU."""
    import torch

    if not torch.cuda.is_available():
        return {}
    return {"peak_mem_gib": torch.cuda.max_memory_allocated() / GIB, "peak_reserved_gib": torch.cuda.max_memory_reserved() / GIB}
