"""The parts of a ZeRO-1/2 CPU-offload optimizer step, timed alone on this machine's CPU and PCIe link.

DeepSpeed's offload step (`stage_1_and_2.step` with `offload_optimizer`) runs, after the last backward: the gradient
partition's copy to host memory, the clip on the CPU, DeepSpeedCPUAdam over the fp32 master weights, the fp32 -> bf16
conversion into a pinned buffer and its copy to the GPU. This times each on N parameters (default 1e9; every part is
memory- or link-bound, so it scales linearly to a model's size), and whether the CPU Adam can run beside GPU work:
a thread running it while the main thread keeps launching GPU matrix products (DeepSpeed's Adam op holds Python's GIL
for its whole call; torch's CPU kernels release it).

    python benchmarks/offload_step.py --params 1e9 --json out.json
"""

from __future__ import annotations

import argparse
import json
import threading
import time

import torch


def timed(fn, repeat: int = 3) -> float:
    """Best of `repeat` wall-clock seconds, CUDA synchronised."""
    best = float("inf")
    for _ in range(repeat):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def gpu_busy_loop(seconds: float, stop: threading.Event | None = None) -> float:
    """Matrix products launched from this thread for `seconds` (or until `stop`): TFLOP/s achieved."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds and not (stop and stop.is_set()):
        for _ in range(4):  # ~0.6 ms each on an H100: the host must keep up to keep the GPU busy
            a @ b
        n += 4
        torch.cuda.synchronize()
    return n * 2 * 8192 ** 3 / (time.perf_counter() - t0) / 1e12


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=1e9)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    n = int(args.params)
    result: dict = {"params": n, "torch_threads": torch.get_num_threads()}

    grad_gpu = torch.randn(n, device="cuda", dtype=torch.float32)
    grad_host = torch.empty(n, dtype=torch.float32, pin_memory=True)
    master = torch.randn(n, dtype=torch.float32) * 0.02
    bf16_host = torch.empty(n, dtype=torch.bfloat16, pin_memory=True)
    bf16_gpu = torch.empty(n, device="cuda", dtype=torch.bfloat16)
    gib = n * 4 / 2**30

    result["d2h_fp32_s"] = timed(lambda: grad_host.copy_(grad_gpu, non_blocking=True))
    result["d2h_fp32_GiBps"] = gib / result["d2h_fp32_s"]
    grad_host.copy_(grad_gpu)
    result["clip_mul_cpu_s"] = timed(lambda: grad_host.mul_(0.999))
    result["to_bf16_cpu_s"] = timed(lambda: bf16_host.copy_(master))
    result["h2d_bf16_s"] = timed(lambda: bf16_gpu.copy_(bf16_host, non_blocking=True))
    result["h2d_bf16_GiBps"] = gib / 2 / result["h2d_bf16_s"]

    param = torch.nn.Parameter(master)
    param.grad = grad_host
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    ds_adam = DeepSpeedCPUAdam([param], lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, adamw_mode=True)
    ds_adam.step()  # allocates the moments
    result["ds_cpu_adam_s"] = timed(ds_adam.step)
    del ds_adam
    torch_adam = torch.optim.AdamW([param], lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    torch_adam.step()
    result["torch_fused_adamw_cpu_s"] = timed(torch_adam.step)

    # Beside GPU work: the GPU loop alone, then with each Adam stepping twice in a thread.
    def beside_gpu(name: str, step) -> None:
        stop = threading.Event()
        t = threading.Thread(target=lambda: (step(), step(), stop.set()))
        t0 = time.perf_counter()
        t.start()
        result[f"gpu_beside_{name}_tflops"] = gpu_busy_loop(60.0, stop)
        t.join()
        result[f"{name}_beside_gpu_s"] = (time.perf_counter() - t0) / 2

    result["gpu_alone_tflops"] = gpu_busy_loop(3.0)
    beside_gpu("torch_fused_adamw_cpu", torch_adam.step)
    del torch_adam
    ds_adam = DeepSpeedCPUAdam([param], lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, adamw_mode=True)
    ds_adam.step()
    beside_gpu("ds_cpu_adam", ds_adam.step)

    for key, value in result.items():
        print(f"{key:36s} {value:.3f}" if isinstance(value, float) else f"{key:36s} {value}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
