#!/usr/bin/env python3
"""Attention kernels alone, forward + backward, on the trainer's shapes: SDPA (flash, cuDNN) against FlashAttention-4
through the project's own wrapper (src/model_utils/fast.py: custom op, eager and under torch.compile).

    python benchmarks/attention.py                       # Qwen3-0.6B at seq 4096, micro-batch 8 (bf16, causal, GQA)
    python benchmarks/attention.py --batch 2 --heads 32 --kv_heads 8

Prints, per kernel: ms per forward (with autograd's saved state, as in training), per backward (the difference) and
per forward+backward, TFLOP/s counting the causal half of the 4·B·H·T²·D forward matmul
FLOPs (x3.5 for forward+backward, FlashAttention's convention), and the largest difference of the output and the
gradients from SDPA's flash kernel (bf16).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


def timed(fn, iters: int) -> float:
    import torch

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv_heads", type=int, default=8)
    p.add_argument("--head_dim", type=int, default=128)
    p.add_argument("--iters", type=int, default=20)
    a = p.parse_args(argv)

    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from model_utils import fast

    if not torch.cuda.is_available():
        print("attention benchmark: no CUDA GPU here")
        return 2
    torch.manual_seed(0)
    b, t, h, kv, d = a.batch, a.seq, a.heads, a.kv_heads, a.head_dim
    dev, dt = "cuda", torch.bfloat16
    # transformers' layout: (batch, heads, seq, head_dim) views of the projections' (batch, seq, heads, head_dim)
    q0 = torch.randn(b, t, h, d, device=dev, dtype=dt).transpose(1, 2)
    k0 = torch.randn(b, t, kv, d, device=dev, dtype=dt).transpose(1, 2)
    v0 = torch.randn(b, t, kv, d, device=dev, dtype=dt).transpose(1, 2)
    grad = torch.randn(b, t, h, d, device=dev, dtype=dt)
    flops = 4 * b * h * t * t * d / 2 * 3.5  # causal half; backward = 2.5x forward

    class Module(torch.nn.Module):
        is_causal = True

    module = Module()

    def sdpa(q, k, v):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return out.transpose(1, 2)

    def run_with(fn, backend=None):
        def step(backward=True):
            q, k, v = (x.detach().requires_grad_() for x in (q0, k0, v0))
            if backend is None:
                out = fn(q, k, v)
            else:
                with sdpa_kernel([backend]):
                    out = fn(q, k, v)
            if not backward:
                return out
            out.backward(grad)
            return out, q.grad, k.grad, v.grad
        return step

    kernels = {"sdpa-flash": run_with(sdpa, SDPBackend.FLASH_ATTENTION),
               "sdpa-cudnn": run_with(sdpa, SDPBackend.CUDNN_ATTENTION)}
    reason = fast.fa4_unavailable_reason()
    if reason is None:
        fast._register_fa4()

        def fa4(q, k, v):
            return fast.fa4_attention(module, q, k, v, None, scaling=d ** -0.5)[0]

        kernels["fa4 (project op)"] = run_with(fa4)
        kernels["fa4 (project op, compiled)"] = run_with(torch.compile(fa4, fullgraph=True))
    else:
        print(f"FlashAttention-4 not measured: {reason}")

    reference = kernels["sdpa-flash"]()
    print(f"shape: batch {b}, seq {t}, heads {h}, kv heads {kv}, head_dim {d}, bf16, causal")
    print("| kernel | ms fwd | ms bwd | ms fwd+bwd | TFLOP/s fwd | TFLOP/s bwd | TFLOP/s | max |out diff| "
          "| max |dq diff| | max |dk diff| | max |dv diff| |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, step in kernels.items():
        try:
            result = step()
            diffs = [float((x.detach().float() - y.detach().float()).abs().max()) for x, y in zip(result, reference)]
            ms = timed(step, a.iters)
            fwd = timed(lambda: step(backward=False), a.iters)
        except RuntimeError as e:  # e.g. a backend that does not take this shape
            print(f"| {name} | failed: {str(e).splitlines()[0][:120]} | | | | | | | | | |")
            continue
        bwd = ms - fwd
        print(f"| {name} | {fwd:.2f} | {bwd:.2f} | {ms:.2f} | {flops / 3.5 / fwd / 1e9:.0f} | "
              f"{flops * 2.5 / 3.5 / bwd / 1e9:.0f} | {flops / ms / 1e9:.0f} | "
              + " | ".join(f"{x:.3g}" for x in diffs) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
