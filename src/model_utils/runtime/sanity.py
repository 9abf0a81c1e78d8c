"""Distributed sanity check: run by every launcher instead of training (`--sanity_check`).

Every rank all-reduces tensors of growing size, verifies the sum (a wrong result means broken communication, not a
slow one), and rank 0 prints the bus bandwidth per message size (NCCL-tests convention: algbw x 2(n-1)/n) and which
rank was slowest. NCCL on GPUs, gloo on CPU.
"""

from __future__ import annotations

import socket
import time

import torch

from model_utils.runtime.distributed import Dist

GPU_SIZES_MIB = [0.0625, 1, 16, 64, 256, 1024]
CPU_SIZES_MIB = [0.0625, 1, 4, 16]


def all_reduce_check(dist: Dist, repeats: int = 5) -> int:
    """Return 0 when every sum is right, 1 otherwise (every rank returns the same)."""
    cuda = dist.device.type == "cuda"
    sizes = GPU_SIZES_MIB if cuda else CPU_SIZES_MIB
    dtype = torch.bfloat16 if cuda else torch.float32
    elem = torch.tensor([], dtype=dtype).element_size()
    n = dist.world_size
    hosts = dist.all_gather_object(socket.gethostname())
    if dist.is_main:
        print(f"sanity: {n} ranks on {len(set(hosts))} node(s) ({', '.join(sorted(set(hosts)))}), backend {dist.backend}, "
              f"device {torch.cuda.get_device_name(dist.device) if cuda else 'cpu'}", flush=True)
        print(f"{'size':>10} {'time (ms)':>10} {'algbw GB/s':>11} {'busbw GB/s':>11} {'slowest rank':>13}  result", flush=True)
    all_ok = True
    for mib in sizes:
        count = max(1, int(mib * 2**20 / elem))
        # Rank r contributes r + 1 everywhere: the sum is n(n+1)/2, exact in bf16 for the world sizes we run.
        tensor = torch.full((count,), float(dist.rank + 1), dtype=dtype, device=dist.device)
        expected = n * (n + 1) / 2
        work = tensor.clone()
        dist.all_reduce(work)  # warm-up (connection set-up)
        times = []
        for _ in range(repeats):
            work.copy_(tensor)
            dist.barrier()
            if cuda:
                torch.cuda.synchronize(dist.device)
            t0 = time.perf_counter()
            dist.all_reduce(work)
            if cuda:
                torch.cuda.synchronize(dist.device)
            times.append(time.perf_counter() - t0)
        ok = bool(torch.all(work == expected).item())
        seconds = sorted(times)[len(times) // 2]
        gathered = dist.all_gather_object((seconds, ok))
        ok_everywhere = all(g[1] for g in gathered)
        all_ok &= ok_everywhere
        slowest = max(range(n), key=lambda r: gathered[r][0])
        t = max(g[0] for g in gathered)
        algbw = count * elem / t / 1e9
        busbw = algbw * 2 * (n - 1) / n if n > 1 else algbw
        if dist.is_main:
            size = f"{mib * 1024:.0f} KiB" if mib < 1 else f"{mib:.0f} MiB"
            print(f"{size:>10} {t * 1e3:>10.3f} {algbw:>11.2f} {busbw:>11.2f} {slowest:>7} ({hosts[slowest]})  "
                  f"{'ok' if ok_everywhere else 'WRONG SUM'}", flush=True)
    if dist.is_main:
        print("sanity: all sums correct" if all_ok else "sanity: FAILED: some ranks computed a wrong sum", flush=True)
    return 0 if all_ok else 1
