"""Examples packed into blocks. An example of n tokens fills n - 1 positions of a block (inputs: its first n - 1 tokens,
targets: its last n - 1, already shifted), so a block of seq_len positions holds examples of up to seq_len + 1
tokens. Examples are placed whole, best fit by decreasing length (deterministic), and the rest of a block is padding
(target -100). An example never attends to another: positions restart at 0 for every example (and for the padding),
which is what `data.blocks.document_positions` gives EOS-separated documents, so the same transformers masking and
FlashAttention-4 varlen path (`document_boundaries`) applies. An example longer than seq_len + 1 tokens keeps its
first seq_len + 1 tokens (counted as truncated); one left with no token carrying loss is dropped (counted).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from model_utils.data.blocks import document_boundaries as boundaries_of
from model_utils.data.sft.encode import Example
from model_utils.data.sft.formats import IGNORE_INDEX
from model_utils.data.tokens import token_dtype


# --------------------------------------------------------------------------------------------------------------------
# Examples -> packed blocks
# --------------------------------------------------------------------------------------------------------------------
@dataclass
class PackingStats:
    """What packing made of the examples: for the run's data line and the cache's meta.json."""

    examples: int = 0  # examples placed in blocks
    tokens: int = 0  # positions the examples fill (an example of n tokens fills n - 1)
    loss_tokens: int = 0  # of those, positions whose target carries loss
    truncated: int = 0  # examples longer than seq_len + 1 tokens, cut to their first seq_len + 1
    dropped: int = 0  # examples left without a target carrying loss (or shorter than 2 tokens), not placed
    blocks: int = 0
    seq_len: int = 0

    @property
    def loss_share(self) -> float:
        return self.loss_tokens / self.tokens if self.tokens else 0.0

    @property
    def padding_share(self) -> float:
        slots = self.blocks * self.seq_len
        return 1 - self.tokens / slots if slots else 0.0

    def describe(self) -> str:
        return (f"{self.examples:,} examples, {self.tokens:,} tokens, {100 * self.loss_share:.1f}% with loss, "
                f"{self.truncated:,} truncated to {self.seq_len + 1} tokens, {self.dropped:,} dropped without loss "
                f"-> {self.blocks:,} blocks of {self.seq_len} ({100 * self.padding_share:.1f}% padding)")


def shifted(example: Example, seq_len: int) -> tuple[np.ndarray, np.ndarray, bool]:
    """(inputs, targets, truncated): an example's first n - 1 tokens and its last n - 1 labels, at most seq_len."""
    truncated = len(example.ids) > seq_len + 1
    ids = np.asarray(example.ids[:seq_len + 1], dtype=np.int64)
    labels = np.asarray(example.labels[:seq_len + 1], dtype=np.int64)
    return ids[:-1], labels[1:], truncated


def best_fit_blocks(lengths: list[int], seq_len: int) -> list[list[int]]:
    """Example indices per block: by decreasing length (ties by index), each into the fullest block it still fits;
    within a block, examples in their original order. Deterministic for the same lengths."""
    free: list[tuple[int, int]] = []  # (room left, block), sorted
    blocks: list[list[int]] = []
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        need = lengths[index]
        at = bisect.bisect_left(free, (need, -1))
        if at == len(free):
            blocks.append([index])
            room, block = seq_len - need, len(blocks) - 1
        else:
            room, block = free.pop(at)
            blocks[block].append(index)
            room -= need
        if room > 0:
            bisect.insort(free, (room, block))
    return [sorted(b) for b in blocks]


@dataclass
class PackedArrays:
    """Blocks of seq_len positions, flat: input ids, shifted targets (IGNORE_INDEX: no loss) and each position's
    index within its example (0 where an example, or the padding, starts)."""

    inputs: np.ndarray
    targets: np.ndarray
    positions: np.ndarray
    stats: PackingStats = field(default_factory=PackingStats)


def pack_examples(examples: Iterable[Example], seq_len: int, pad_id: int, vocab_size: int) -> PackedArrays:
    """Pack examples whole into blocks of seq_len (module docstring: truncation, dropping, padding)."""
    stats = PackingStats(seq_len=seq_len)
    pieces: list[tuple[np.ndarray, np.ndarray]] = []
    for example in examples:
        inputs, targets, truncated = shifted(example, seq_len)
        if len(inputs) == 0 or not (targets != IGNORE_INDEX).any():
            stats.dropped += 1
            continue
        stats.truncated += truncated
        stats.loss_tokens += int((targets != IGNORE_INDEX).sum())
        stats.tokens += len(inputs)
        pieces.append((inputs, targets))
    stats.examples = len(pieces)
    layout = best_fit_blocks([len(p[0]) for p in pieces], seq_len)
    stats.blocks = len(layout)
    inputs = np.full(len(layout) * seq_len, pad_id, dtype=token_dtype(vocab_size))
    targets = np.full(len(layout) * seq_len, IGNORE_INDEX, dtype=np.int32)
    positions = np.zeros(len(layout) * seq_len, dtype=np.uint16 if seq_len <= 1 << 16 else np.int32)
    for block, members in enumerate(layout):
        at = block * seq_len
        for index in members:
            piece_inputs, piece_targets = pieces[index]
            n = len(piece_inputs)
            inputs[at:at + n], targets[at:at + n], positions[at:at + n] = piece_inputs, piece_targets, np.arange(n)
            at += n
        end = (block + 1) * seq_len
        positions[at:end] = np.arange(end - at)  # the padding is a segment of its own
    return PackedArrays(inputs, targets, positions, stats)


class PackedExamples:
    """Packed SFT blocks read like `data.blocks.PackedTokens`: `num_blocks`, `seq_len`, `tokens` (the flat input
    ids, for the data fingerprint) and `batch(indices)`, here an `ExampleBatch` rather than a token array."""

    def __init__(self, inputs: np.ndarray, targets: np.ndarray, positions: np.ndarray, seq_len: int):
        self.tokens, self.targets, self.positions = inputs, targets, positions
        self.seq_len = seq_len
        self.num_blocks = len(inputs) // seq_len

    def _rows(self, array: np.ndarray, indices) -> np.ndarray:
        return np.stack([array[int(i) * self.seq_len:(int(i) + 1) * self.seq_len] for i in indices]).astype(np.int64)

    def batch(self, indices) -> ExampleBatch:
        return ExampleBatch(self._rows(self.tokens, indices), self._rows(self.targets, indices),
                            self._rows(self.positions, indices))


@dataclass
class ExampleBatch:
    """Rows of blocks (int64, B x seq_len): input ids, shifted targets, positions within each example."""

    input_ids: np.ndarray
    targets: np.ndarray
    position_ids: np.ndarray

    def model_arrays(self, document_boundaries: bool = False) -> dict:
        """The model's keyword arguments as host arrays (the loop moves each to the device): `labels` and
        `shift_labels` are the shifted targets, as `train.step.model_inputs` gives them; with
        `document_boundaries` (FlashAttention-4) also the examples' offsets in the flattened batch."""
        arrays = {"input_ids": self.input_ids, "labels": self.targets, "shift_labels": self.targets,
                  "position_ids": self.position_ids}
        if document_boundaries:
            cu = boundaries_of(self.position_ids)
            seq_len = self.input_ids.shape[1]
            arrays.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=seq_len, max_length_k=seq_len)
        return arrays

    @property
    def loss_tokens(self) -> int:
        """Targets carrying loss: the count the mean loss of the batch divides by."""
        return int((self.targets != IGNORE_INDEX).sum())


