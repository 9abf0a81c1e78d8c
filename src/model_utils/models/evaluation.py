"""The validation loss without the full-vocabulary logits.

Training's loss never materialises the logits (Liger's fused linear cross-entropy), but a model in eval mode computes
them for the whole batch and upcasts them to fp32 (micro-batch x tokens x vocabulary x 4 bytes), more than the
training step needs with a large vocabulary. Here the model runs as usual, except that its output
embedding (the LM head) sees only the first position; its full input (the final hidden states) is captured and the
cross-entropy is taken over the LM head in chunks of `CHUNK_TOKENS` tokens, so evaluation needs less memory than a
training step at the same micro-batch.

Models that post-process their logits (softcapping, scaling) would get a different loss that way: the model's own
logits at the first position are compared with the LM head's, and where they differ the batch is evaluated through
the model's own loss one sequence at a time instead.
"""

from __future__ import annotations

from contextlib import contextmanager

from model_utils.data.sft.formats import IGNORE_INDEX

CHUNK_TOKENS = 2048  # fp32 logits of one chunk: 2048 x 151,936 x 4 bytes = 1.2 GiB for Qwen3


@contextmanager
def first_position_logits(head):
    """While active, `head` (the output embedding) computes logits for the first position only; the hidden states it
    was given are left in the yielded dict under "hidden"."""
    captured = {}

    def keep_first_position(module, args):
        captured["hidden"] = args[0]
        return (args[0][..., :1, :], *args[1:])

    handle = head.register_forward_pre_hook(keep_first_position)
    try:
        yield captured
    finally:
        handle.remove()


def chunked_cross_entropy(head, hidden, targets, chunk_tokens: int = CHUNK_TOKENS):
    """Mean next-token cross-entropy of `hidden` (..., H) through `head` against `targets` (...), chunk by chunk: over
    the targets that carry loss (-100 marks those that do not: prompts and padding of fine-tuning data)."""
    import torch
    import torch.nn.functional as F

    flat, labels = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    total = torch.zeros((), device=hidden.device, dtype=torch.float64)
    for start in range(0, flat.shape[0], chunk_tokens):
        logits = head(flat[start:start + chunk_tokens]).float()
        total += F.cross_entropy(logits, labels[start:start + chunk_tokens], reduction="sum").double()
    return total / max(int(loss_targets(labels)), 1)


def evaluation_loss(engine, model, batch: dict):
    """(the loss of `batch`, the trainer's model inputs with `labels`, summed over the targets that carry loss; their
    count), float64 tensors, under torch.no_grad: a validation set's loss is the sum over its micro-batches divided by
    their count, each token weighing the same as in training (fine-tuning's micro-batches hold different numbers of
    answer tokens)."""
    import torch

    targets = batch["labels"]
    count = loss_targets(targets)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None:
        return _summed(engine(**batch, use_cache=False).loss, count), count
    inputs = {k: v for k, v in batch.items() if k not in ("labels", "shift_labels")}
    with first_position_logits(head) as captured:
        logits = engine(**inputs, use_cache=False).logits
    hidden = captured.get("hidden")
    if hidden is None or hidden.shape[:-1] != targets.shape:
        return _per_sequence_loss(engine, batch), count
    if not torch.allclose(logits.float(), head(hidden[..., :1, :]).float(), rtol=1e-3, atol=1e-3):
        return _per_sequence_loss(engine, batch), count  # the model post-processes its logits: use its own loss
    return _summed(chunked_cross_entropy(head, hidden, targets), count), count


def loss_targets(labels):
    """How many of `labels` carry loss (not IGNORE_INDEX: prompts and padding of fine-tuning data), float64."""
    return (labels != IGNORE_INDEX).sum().double()


def _summed(mean, count):
    """A mean loss over `count` targets as their sum (0 where none carries loss, whose mean is not a number)."""
    return mean.double() * count if count > 0 else count * 0


def _per_sequence_loss(engine, batch: dict):
    """The model's own loss summed over the targets that carry loss, one sequence of the batch at a time (logits of
    one sequence in memory). Documents given as boundaries over the whole batch (FlashAttention-4 with
    --document_mask) cannot be split by row: the whole batch then goes through the model's loss."""
    targets = batch["labels"]
    if "cu_seq_lens_q" in batch:
        return _summed(engine(**batch, use_cache=False).loss, loss_targets(targets))
    rows = batch["input_ids"].shape[0]
    total = 0
    for i in range(rows):
        row = {k: v[i:i + 1] if _per_row(v, rows) else v for k, v in batch.items()}
        total = total + _summed(engine(**row, use_cache=False).loss, loss_targets(targets[i]))
    return total


def _per_row(value, rows: int) -> bool:
    return hasattr(value, "shape") and value.dim() >= 1 and value.shape[0] == rows
