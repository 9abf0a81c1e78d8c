#!/usr/bin/env python3
"""Attention kernels alone, forward + backward, on the trainer's shapes: SDPA (flash, cuDNN) against FlashAttention-4
through the project's own wrapper (src/model_utils/patches/flash_attn4.py: custom op, eager and under torch.compile).

    python benchmarks/attention.py                       # Qwen3-0.6B at seq 4096, micro-batch 8 (bf16, causal, GQA)
    python benchmarks/attention.py --batch 2 --heads 32 --kv_heads 8
    python benchmarks/attention.py --document_length 1000  # --document_mask: documents of ~1,000 tokens per row
    python benchmarks/attention.py --batch 5 --heads 32 --kv_heads 32 --document_length 600  # the 7B SFT journey

Prints, per kernel: ms per forward (with autograd's saved state, as in training), per backward (the difference) and
per forward+backward, TFLOP/s counting the causal half of the 4·B·H·T²·D forward matmul
FLOPs (x3.5 for forward+backward, FlashAttention's convention), and the largest difference of the output and the
gradients from SDPA's flash kernel (bf16). With --document_length, attention stays within documents of that mean
length (geometric, cut by the row's end, as packing cuts them): SDPA with the dense per-document mask transformers
builds against FA4's variable-length kernels, PyTorch's varlen_attn, SDPA once per document and FlexAttention with a
document block mask (the paths without FlashAttention-4), each given the documents' boundaries; FLOPs count the
causal half of each document's square, and the reference is SDPA's memory-efficient kernel with the mask.
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
    p.add_argument("--document_length", type=int, default=0, help="mean document length (0: one causal sequence)")
    a = p.parse_args(argv)

    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from model_utils.patches import flash_attn4

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
    mask = documents = None
    if a.document_length:
        import numpy as np

        from model_utils.data.blocks import document_boundaries

        rng = np.random.default_rng(0)
        lengths = [np.diff(np.minimum(np.append(0, np.cumsum(rng.geometric(1 / a.document_length, t))), t))
                   for _ in range(b)]
        starts = np.zeros((b, t), dtype=np.int64)  # 0 where a document starts: the positions' zeros
        for row, row_lengths in enumerate(lengths):
            starts[row, 1:] = 1
            starts[row, np.cumsum(row_lengths[row_lengths > 0])[:-1]] = 0
        bounds = torch.from_numpy(document_boundaries(starts)).to(dev)
        doc = torch.from_numpy(starts == 0).to(dev).cumsum(-1)
        mask = ((doc[:, :, None] == doc[:, None, :]) & torch.ones(t, t, dtype=torch.bool, device=dev).tril())[:, None]
        documents = dict(cu_seq_lens_q=bounds, cu_seq_lens_k=bounds, max_length_q=t, max_length_k=t)
        sizes = torch.diff(bounds).double()
        flops = 4 * h * d * float((sizes * sizes).sum()) / 2 * 3.5

    class Module(torch.nn.Module):  # what transformers' attention functions read of a model's attention layer
        is_causal = True
        num_key_value_groups = h // kv  # grouped-query attention: each key/value head serves this many query heads

    module = Module()

    def sdpa(q, k, v):
        if mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:  # with a mask, SDPA's GQA has no fused kernel: the KV heads repeated, as transformers' SDPA path does
            k, v = (x.repeat_interleave(h // kv, dim=1) for x in (k, v))
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
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

    kernels = ({"sdpa-flash": run_with(sdpa, SDPBackend.FLASH_ATTENTION)} if mask is None
               else {"sdpa-efficient (mask)": run_with(sdpa, SDPBackend.EFFICIENT_ATTENTION)})
    kernels["sdpa-cudnn" + (" (mask)" if mask is not None else "")] = run_with(sdpa, SDPBackend.CUDNN_ATTENTION)
    reason = flash_attn4.fa4_unavailable_reason()
    if reason is None:
        flash_attn4._register_fa4()

        def fa4(q, k, v):
            return flash_attn4.fa4_attention(module, q, k, v, mask, scaling=d ** -0.5, **(documents or {}))[0]

        kind = "fa4 varlen" if documents else "fa4"
        kernels[f"{kind} (project op)"] = run_with(fa4)
        kernels[f"{kind} (project op, compiled)"] = run_with(torch.compile(fa4, fullgraph=True))
    else:
        print(f"FlashAttention-4 not measured: {reason}")
    if documents:  # the paths without FlashAttention-4 (src/model_utils/models/document_attention.py)
        from model_utils.models import document_attention

        def per_document(fn):
            return lambda q, k, v: fn(module, q, k, v, None, scaling=d ** -0.5, **documents)[0]

        if (varlen_reason := document_attention.varlen_unavailable_reason()) is None:
            kernels["varlen_attn (project path)"] = run_with(per_document(document_attention.varlen_documents))
            kernels["varlen_attn (project path, compiled)"] = run_with(
                torch.compile(per_document(document_attention.varlen_documents)))
        else:
            print(f"PyTorch's varlen not measured: {varlen_reason}")
        kernels["sdpa once per document"] = run_with(per_document(document_attention.document_sdpa))
        # FlexAttention with a document mask (PyTorch's other path without a dense mask, compiled as its docs
        # require): the block mask built once, and built again at every call, which a trainer pays once per
        # micro-batch for all of its layers
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        def document_causal(row, head, q_index, kv_index):
            return (doc[row, q_index] == doc[row, kv_index]) & (q_index >= kv_index)

        def block_mask():
            return create_block_mask(document_causal, B=b, H=None, Q_LEN=t, KV_LEN=t, device=dev)

        flex_compiled, built = torch.compile(flex_attention), block_mask()

        def flex(q, k, v, block=None):
            block = built if block is None else block
            return flex_compiled(q, k, v, block_mask=block, enable_gqa=True, scale=d ** -0.5).transpose(1, 2)

        kernels["flex_attention (compiled, document block mask)"] = run_with(flex)
        kernels["flex_attention, its block mask built at each call"] = run_with(lambda q, k, v: flex(q, k, v,
                                                                                                     block_mask()))

    reference = next(iter(kernels.values()))()
    within = f", within {len(bounds) - 1} documents (mean length {t * b / (len(bounds) - 1):,.0f})" if documents else ""
    print(f"shape: batch {b}, seq {t}, heads {h}, kv heads {kv}, head_dim {d}, bf16, causal{within}")
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
