#!/usr/bin/env python3
"""Where a background save's training stall goes: the host copy of one rank's state (checkpoint.background.host_copy
into HostBuffers), the first save against a later one, under each way of pinning host memory.

    python benchmarks/save_stall.py --gpus 4        # one rank's share of Llama-2-7B's ZeRO-3 state
    python benchmarks/save_stall.py --parameters 50000000 --gpus 1   # CPU smoke run

One rank's ZeRO-3 state with Adam in bf16 training: its partition of the bf16 parameters, the fp32 master copy and
Adam's two moments, each cut into DeepSpeed's sub-groups (`sub_group_size`, 1e9 elements), allocated on the GPU and
copied twice (the first save allocates and pins its host buffers, the second reuses them). Each way of pinning runs in
its own process, since PyTorch reads PYTORCH_CUDA_ALLOC_CONF once:

- `host_alloc`: PyTorch's default pinned allocator (cudaHostAlloc on one thread),
- `host_register`: the same allocator set as the trainer sets it (runtime.process.PINNED_MEMORY_SETTINGS: pages mapped
  by 8 threads, then cudaHostRegister),
- `pageable`: host memory not pinned.

Both pinned ways round each size up to a power of two.

Every way runs with OMP_NUM_THREADS=1, as the launchers start each rank.

Also timed: the allocation alone, of fresh buffers beside those in use (what pinning costs without the copy).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from model_utils.runtime.process import PINNED_MEMORY_SETTINGS  # noqa: E402

LLAMA_2_7B = 6_738_415_616
SUB_GROUP = 10**9  # ZeRO-3's default sub_group_size (elements)
WAYS = {"host_alloc": "", "host_register": PINNED_MEMORY_SETTINGS, "pageable": ""}  # way: its allocator setting


def state_sizes(parameters: int, gpus: int) -> list[int]:
    """Bytes of each storage of one rank's ZeRO-3 state: the bf16 partition, then fp32 master, exp_avg, exp_avg_sq
    per sub-group."""
    share = -(-parameters // gpus)
    groups = [min(SUB_GROUP, share - start) for start in range(0, share, SUB_GROUP)]
    return [2 * share] + [4 * n for n in groups for _ in range(3)]


def worker(way: str, sizes: list[int]) -> dict:
    import torch

    from model_utils.checkpoint.background import HostBuffers, host_copy

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    state = {f"t{i}": torch.empty(n // 2, dtype=torch.bfloat16, device=device) for i, n in enumerate(sizes)}

    def sync():
        if cuda:
            torch.cuda.synchronize()

    buffers = HostBuffers(pinned=cuda and way != "pageable")
    out = {"way": way, "gib": sum(sizes) / 2**30, "storages": len(sizes)}
    for name in ("first", "second"):
        memo = {"taken": []}
        t = time.perf_counter()
        host_copy(state, memo, buffers)
        sync()
        out[f"{name}_s"] = time.perf_counter() - t
        buffers.give_back(memo["taken"])
    # the allocation alone, fresh buffers (what a save ahead of the first would take)
    t = time.perf_counter()
    fresh = HostBuffers(pinned=buffers.pinned)
    taken = [fresh.take(n) for n in sizes]
    out["allocate_s"] = time.perf_counter() - t
    del taken, fresh
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parameters", type=int, default=LLAMA_2_7B, help="the model's parameters (default Llama-2-7B's)")
    p.add_argument("--gpus", type=int, default=4, help="ranks the state is partitioned over")
    p.add_argument("--ways", nargs="+", default=list(WAYS), choices=list(WAYS))
    p.add_argument("--json", default=None, help="append one JSON line per way")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        job = json.loads(a.worker)
        print("RESULT " + json.dumps(worker(job["way"], job["sizes"])), flush=True)
        return 0
    sizes = state_sizes(a.parameters, a.gpus)
    print(f"# {a.parameters:,} parameters over {a.gpus} GPU(s): one rank's state {sum(sizes) / 2**30:.1f} GiB in "
          f"{len(sizes)} storages")
    for way in a.ways:
        env = dict(os.environ, OMP_NUM_THREADS="1")
        if WAYS[way]:
            env["PYTORCH_CUDA_ALLOC_CONF"] = ",".join(x for x in (env.get("PYTORCH_CUDA_ALLOC_CONF"), WAYS[way]) if x)
        job = json.dumps({"way": way, "sizes": sizes})
        done = subprocess.run([sys.executable, __file__, "--worker", job], env=env, capture_output=True, text=True)
        lines = [line[7:] for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        if done.returncode or not lines:
            print(f"{way}: failed (exit {done.returncode})\n{done.stderr[-2000:]}")
            continue
        result = dict(json.loads(lines[-1]), parameters=a.parameters, gpus=a.gpus)
        print(json.dumps(result), flush=True)
        if a.json:
            with open(a.json, "a") as f:
                f.write(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
