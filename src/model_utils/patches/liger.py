"""Liger-Kernel's fused linear cross-entropy, in fewer and larger chunks.

Liger's model losses call `liger_kernel.transformers.functional.liger_fused_linear_cross_entropy` (looked up at call
time) without a `chunk_mem_const`, so its default of 1 applies: a large vocabulary cuts the batch into many small
chunks, and each chunk reads and writes the bf16 LM-head gradient once (docs/PERFORMANCE.md gives the chunks and the
gain). The patch makes the trainer's budget that function's default.
"""

from __future__ import annotations

import functools
import inspect

from model_utils.patches import Patch, gate

FLCE_CHUNK_BUDGET = Patch(
    "liger-kernel", "0.8.5", "0.8.5",
    "liger_kernel.transformers.functional.liger_fused_linear_cross_entropy: replaced (process-wide) by a wrapper "
    "whose chunk_mem_const defaults to --flce_chunk_budget",
    "a faster step at the same loss (docs/PERFORMANCE.md, Speed options: In force by default; the loss check against the "
    "unfused path stays within bf16 noise)",
    ("tests/unit/patches/test_patches.py::test_flce_chunk_budget_becomes_the_default_of_ligers_loss_function",))


# Long sequences: Liger's transient logits stay within this many bytes where a budget allows it (a micro-batch of
# 65,536 tokens of Llama 3.1 8B keeps the default budget, 8). At 262,144 tokens the default would hold 15.7 GiB of
# logits (65,536 tokens of a 128k vocabulary) beside the step; chunks of 16,384 tokens fill the LM head's matmuls as well.
FLCE_LOGITS_BYTES = 4 * 1024**3


def logits_chunk_bytes(budget: int, tokens: int, hidden_size: int, vocab_size: int) -> int:
    """The 16-bit transient logits of Liger 0.8.5's fused linear cross-entropy over `tokens` at chunk_mem_const `budget`:
    chunks of next_power_of_2(ceil(tokens / ceil(vocab / (budget x hidden)))) tokens, at most `tokens`."""
    per_chunk = -(-tokens // -(-vocab_size // (budget * hidden_size)))
    return min(1 << (per_chunk - 1).bit_length(), tokens) * vocab_size * 2


def chunk_budget_in_force(budget: int, tokens: int | None, hidden_size: int, vocab_size: int) -> int:
    """The chunk budget a run's loss uses: --flce_chunk_budget, or the largest below it whose transient logits over the
    `tokens` one forward's loss covers on a GPU stay within FLCE_LOGITS_BYTES, 1 at the least (Liger's smallest: its
    logits can then pass the bound, from 524,289 tokens of Llama 3.1 8B)."""
    if not tokens:
        return budget
    return next((c for c in range(budget, 1, -1)
                 if logits_chunk_bytes(c, tokens, hidden_size, vocab_size) <= FLCE_LOGITS_BYTES), 1)


@functools.cache
def _original():
    from liger_kernel.transformers import functional

    return functional.liger_fused_linear_cross_entropy


def set_flce_chunk_budget(budget: int, log) -> bool:
    """Make `chunk_mem_const=budget` the default of the function Liger's model losses call; False (and the stock
    chunking) on an untested liger-kernel or one without the parameter."""
    if not gate(FLCE_CHUNK_BUDGET, log):
        return False
    from liger_kernel.transformers import functional

    original = _original()
    if "chunk_mem_const" not in inspect.signature(original).parameters:
        log("kernels: this liger-kernel has no chunk_mem_const; its fused cross-entropy keeps its own chunking")
        return False

    @functools.wraps(original)  # keeps the signature, which Liger's loss inspects to filter its kwargs
    def fused_linear_cross_entropy(*args, chunk_mem_const: int = budget, **kwargs):
        return original(*args, chunk_mem_const=chunk_mem_const, **kwargs)

    functional.liger_fused_linear_cross_entropy = fused_linear_cross_entropy
    log(f"kernels: fused linear cross-entropy chunked for {budget}x the hidden states' size of transient logits")
    return True
