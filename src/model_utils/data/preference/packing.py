"""Preference pairs packed into blocks: a pair's chosen and rejected sequences side by side in one block (one forward
scores both), never split across blocks, positions restarting at every sequence so each attends only within itself
(the varlen and document paths fine-tuning's packed examples take, data.sft.packing).

A sequence is its prompt followed by one answer, cut to its first `max_length` tokens as TRL 1.16's DPOTrainer cuts it
(`max_length`, `truncation_mode="keep_start"`); the tokens after the answer's last one carry no loss and are left out.
A sequence of n tokens fills n - 1 positions, so a block of `pair_block_len(max_length)` = 2 x max_length positions
holds any pair whole. A pair with no answer token left within max_length on either side (TRL drops those whose prompt
alone fills max_length) is dropped; both are counted.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from model_utils.config.preference import pair_block_len
from model_utils.data.preference.encode import PairExamples
from model_utils.data.sft.formats import IGNORE_INDEX
from model_utils.data.sft.packing import ExampleBatch, PackedExamples, best_fit_blocks
from model_utils.data.tokens import token_dtype

@dataclass
class PairStats:
    """What packing made of the pairs: for the run's data line and the cache's meta.json."""

    pairs: int = 0  # pairs placed in blocks
    tokens: int = 0  # positions their sequences fill
    answer_tokens: int = 0  # of those, positions whose target is an answer token (chosen and rejected)
    truncated: int = 0  # pairs with an answer cut at max_length
    dropped: int = 0  # pairs with no answer token within max_length on a side
    blocks: int = 0
    max_length: int = 0

    @property
    def padding_share(self) -> float:
        slots = self.blocks * pair_block_len(self.max_length)
        return 1 - self.tokens / slots if slots else 0.0

    def describe(self) -> str:
        return (f"{self.pairs:,} pairs, {self.tokens:,} tokens ({self.answer_tokens:,} in answers), "
                f"{self.truncated:,} truncated to {self.max_length} tokens a sequence, {self.dropped:,} dropped "
                f"without an answer token within them -> {self.blocks:,} blocks of {pair_block_len(self.max_length)} "
                f"({100 * self.padding_share:.1f}% padding)")


def cut(example, max_length: int) -> tuple[np.ndarray, np.ndarray, bool] | None:
    """(inputs, targets, whether the answer was cut) of one sequence shifted for next-token prediction, its tokens
    after the answer's last left out and the rest kept to max_length; None where no answer token is left."""
    labels = np.asarray(example.labels, dtype=np.int64)
    answer = np.flatnonzero(labels != IGNORE_INDEX)
    if len(answer) == 0:
        return None
    end = int(answer[-1]) + 1
    kept = min(end, max_length)
    ids = np.asarray(example.ids[:kept], dtype=np.int64)
    inputs, targets = ids[:-1], labels[1:kept]
    if not (targets != IGNORE_INDEX).any():
        return None
    return inputs, targets, end > max_length


@dataclass
class PackedPairArrays:
    """Blocks flat, as data.sft.packing.PackedArrays, and `pair_offsets`: block b holds pairs pair_offsets[b] to
    pair_offsets[b + 1] - 1, each its chosen then its rejected sequence, in that order from the block's start."""

    inputs: np.ndarray
    targets: np.ndarray
    positions: np.ndarray
    pair_offsets: np.ndarray
    sources: np.ndarray = None  # per pair number, the index of its pair among those given (dropped ones counted)
    stats: PairStats = field(default_factory=PairStats)


def pack_pairs(pairs: Iterable[PairExamples], max_length: int, pad_id: int, vocab_size: int) -> PackedPairArrays:
    """Pack pairs whole into blocks of pair_block_len(max_length), best fit by decreasing length (deterministic); the
    pairs are numbered in block order, which the reference's log-probabilities follow."""
    stats = PairStats(max_length=max_length)
    placed: list[tuple] = []
    given: list[int] = []  # each placed pair's index among those given
    for index, pair in enumerate(pairs):
        chosen, rejected = cut(pair.chosen, max_length), cut(pair.rejected, max_length)
        if chosen is None or rejected is None:
            stats.dropped += 1
            continue
        stats.truncated += chosen[2] or rejected[2]
        for inputs, targets, _ in (chosen, rejected):
            stats.tokens += len(inputs)
            stats.answer_tokens += int((targets != IGNORE_INDEX).sum())
        placed.append((chosen[:2], rejected[:2]))
        given.append(index)
    block_len = pair_block_len(max_length)
    layout = best_fit_blocks([len(c[0]) + len(r[0]) for c, r in placed], block_len)
    stats.pairs, stats.blocks = len(placed), len(layout)
    inputs = np.full(len(layout) * block_len, pad_id, dtype=token_dtype(vocab_size))
    targets = np.full(len(layout) * block_len, IGNORE_INDEX, dtype=np.int32)
    positions = np.zeros(len(layout) * block_len, dtype=np.uint16 if block_len <= 1 << 16 else np.int32)
    offsets = np.zeros(len(layout) + 1, dtype=np.int64)
    sources = np.asarray([given[index] for members in layout for index in members], dtype=np.int64)
    for block, members in enumerate(layout):
        at = block * block_len
        for index in members:
            for piece_inputs, piece_targets in placed[index]:
                n = len(piece_inputs)
                inputs[at:at + n], targets[at:at + n], positions[at:at + n] = piece_inputs, piece_targets, np.arange(n)
                at += n
        end = (block + 1) * block_len
        positions[at:end] = np.arange(end - at)  # the padding is a segment of its own
        offsets[block + 1] = offsets[block] + len(members)
    return PackedPairArrays(inputs, targets, positions, offsets, sources, stats)


class PackedPairs(PackedExamples):
    """Packed pair blocks, read as data.sft.packing.PackedExamples are; `batch(indices)` is a PairBatch."""

    def __init__(self, inputs, targets, positions, pair_offsets, seq_len: int):
        super().__init__(inputs, targets, positions, seq_len)
        self.pair_offsets = np.asarray(pair_offsets, dtype=np.int64)

    @property
    def num_pairs(self) -> int:
        return int(self.pair_offsets[-1])

    def block_pairs(self, block: int) -> range:
        return range(int(self.pair_offsets[block]), int(self.pair_offsets[block + 1]))

    def batch(self, indices) -> PairBatch:
        examples = super().batch(indices)
        rows = []  # per pair: its number, its chosen and rejected sequences among the batch's, its row
        first_segment = 0
        for row, block in enumerate(indices):
            for k, pair in enumerate(self.block_pairs(int(block))):
                rows.append((pair, first_segment + 2 * k, first_segment + 2 * k + 1, row))
            first_segment += int((examples.position_ids[row] == 0).sum())
        return PairBatch(examples.input_ids, examples.targets, examples.position_ids,
                         np.asarray(rows, dtype=np.int64).reshape(-1, 4))


@dataclass
class PairBatch(ExampleBatch):
    """Rows of pair blocks (data.sft.packing.ExampleBatch) and `pairs`: per pair, its number in the split, the indices
    of its chosen and rejected sequences among the batch's sequences (each starting where a position is 0, counted
    row by row) and its row."""

    pairs: np.ndarray = None

    @property
    def num_pairs(self) -> int:
        return len(self.pairs)

    def segment_ids(self) -> np.ndarray:
        """Each position's sequence among the batch's, flattened row by row."""
        return np.cumsum(self.position_ids.reshape(-1) == 0) - 1

    @property
    def segments(self) -> int:
        return int((self.position_ids == 0).sum())

    def answer_tokens(self) -> np.ndarray:
        """Per sequence, its targets that carry loss (its answer tokens)."""
        return np.bincount(self.segment_ids(), weights=(self.targets.reshape(-1) != IGNORE_INDEX),
                           minlength=self.segments)
