"""Packed blocks and the order they are read in. Block i of a token array is tokens[i*T : i*T + T + 1] (inputs its first
T tokens, targets its last T); `BlockOrder` visits the training blocks of epoch e in permutation(seed, e), global
micro-batch k taking positions [k*W*m, (k+1)*W*m) of it, so a `DataPosition` (epoch, blocks consumed) means the same
blocks on any world size and a resumed run reads nothing twice. Document positions and boundaries for --document_mask.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from model_utils.core.problems import Problem
from model_utils.data.errors import DataError

HELD_OUT_SEED = 0  # the held-out validation blocks must not move when the training seed changes


# --------------------------------------------------------------------------------------------------------------------
# Packed blocks and the order they are visited in
# --------------------------------------------------------------------------------------------------------------------
def block_count(num_tokens: int, seq_len: int) -> int:
    """Blocks of seq_len + 1 tokens overlapping by one that num_tokens hold."""
    return max(0, (num_tokens - 1) // seq_len)


class PackedTokens:
    """A flat token array (memory-mapped or in memory) cut into blocks of seq_len + 1 with stride seq_len."""

    def __init__(self, tokens: np.ndarray, seq_len: int):
        self.tokens = tokens
        self.seq_len = seq_len
        self.num_blocks = block_count(len(tokens), seq_len)

    def block(self, i: int) -> np.ndarray:
        start = int(i) * self.seq_len
        return self.tokens[start:start + self.seq_len + 1]

    def batch(self, indices) -> np.ndarray:
        return np.stack([self.block(i) for i in indices]).astype(np.int64)


class ShardedTokens:
    """Token arrays (memory-mapped shards, token files, a mixture's parts) read as one stream in their order: a slice
    may span two arrays, so blocks cross shard boundaries exactly as in one flat file. `note` names what else the
    stream's meaning depends on (token_fingerprint digests it)."""

    def __init__(self, arrays: list, dtype=None, note: str = ""):
        self.arrays = [a for a in arrays if len(a)]
        self.dtype = np.dtype(dtype or (arrays[0].dtype if arrays else np.uint16))
        self.starts = np.zeros(len(self.arrays) + 1, dtype=np.int64)
        np.cumsum([len(a) for a in self.arrays], out=self.starts[1:])
        self.note = note

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, key: slice) -> np.ndarray:
        start, stop, step = key.indices(len(self))
        if step != 1:
            raise IndexError("ShardedTokens reads contiguous slices only")
        if stop <= start:
            return np.zeros(0, self.dtype)
        shard = int(np.searchsorted(self.starts, start, side="right")) - 1
        pieces = []
        while start < stop:
            offset = start - int(self.starts[shard])
            take = min(stop - start, len(self.arrays[shard]) - offset)
            pieces.append(self.arrays[shard][offset:offset + take])
            start += take
            shard += 1
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        whole = np.concatenate(self.arrays) if self.arrays else np.zeros(0, self.dtype)
        return whole.astype(dtype) if dtype is not None else whole


def document_positions(inputs: np.ndarray, eos_id: int) -> np.ndarray:
    """Each token's position within its document, for rows of packed documents separated by EOS (--document_mask):
    0 at the start of a row and right after each EOS (an EOS ends its document). A document cut by a block boundary
    starts again at 0 in its next block."""
    starts = np.zeros(inputs.shape, dtype=bool)
    starts[:, 0] = True
    starts[:, 1:] = inputs[:, :-1] == eos_id
    index = np.broadcast_to(np.arange(inputs.shape[1]), inputs.shape)
    return index - np.maximum.accumulate(np.where(starts, index, 0), axis=1)


def attention_area(positions: np.ndarray) -> int:
    """The query-key pairs of attention within documents (rows of `document_positions`): the sum of each document's
    length squared, the T² of the FLOPs' attention term. A document's tokens at positions 0..n-1 add up 2p+1 to n²."""
    return int((2 * positions.astype(np.int64) + 1).sum())


def document_boundaries(positions: np.ndarray) -> np.ndarray:
    """The documents' offsets in the flattened rows, then the total (FlashAttention's cu_seqlens, int32)."""
    flat = positions.reshape(-1)
    return np.append(np.flatnonzero(flat == 0), flat.size).astype(np.int32)


@dataclass
class DataPosition:
    """Where training is in the data: everything needed to continue exactly, independent of the world size."""

    epoch: int = 0
    blocks_consumed: int = 0  # positions of this epoch's permutation already used, by all ranks together

    def state_dict(self):
        return {"epoch": self.epoch, "blocks_consumed": self.blocks_consumed}

    @classmethod
    def from_state_dict(cls, d):
        return cls(int(d["epoch"]), int(d["blocks_consumed"]))


class BlockOrder:
    """Which blocks each rank reads for each global micro-batch."""

    def __init__(self, block_ids: np.ndarray, seed: int, world_size: int, micro_batch: int):
        self.block_ids = np.asarray(block_ids, dtype=np.int64)
        self.seed = seed
        self.world_size = world_size
        self.micro_batch = micro_batch
        self.per_global_batch = world_size * micro_batch
        if len(self.block_ids) < self.per_global_batch:
            raise DataError(Problem("--seq_len", None,
                                    f"only {len(self.block_ids)} training blocks, fewer than one micro-batch per rank "
                                    f"({micro_batch} x {world_size} ranks)",
                                    "use more data, a smaller seq_len, or a smaller micro-batch"))
        self._cache: tuple[int, np.ndarray] | None = None

    def permutation(self, epoch: int) -> np.ndarray:
        if self._cache is None or self._cache[0] != epoch:
            rng = np.random.default_rng([self.seed, epoch])
            self._cache = (epoch, self.block_ids[rng.permutation(len(self.block_ids))])
        return self._cache[1]

    @property
    def global_batches_per_epoch(self) -> int:
        return len(self.block_ids) // self.per_global_batch

    def rank_indices(self, position: DataPosition, rank: int) -> np.ndarray:
        start = position.blocks_consumed + rank * self.micro_batch
        return self.permutation(position.epoch)[start:start + self.micro_batch]

    def advance(self, position: DataPosition) -> DataPosition:
        """The position after one global micro-batch; a new epoch starts when the next one would not fit."""
        consumed = position.blocks_consumed + self.per_global_batch
        if consumed + self.per_global_batch > len(self.block_ids):
            return DataPosition(position.epoch + 1, 0)
        return DataPosition(position.epoch, consumed)


@dataclass
class PackedData:
    train: PackedTokens
    train_ids: np.ndarray
    val: PackedTokens
    val_ids: np.ndarray
    description: str

    @property
    def train_tokens(self) -> int:
        return len(self.train_ids) * self.train.seq_len


def held_out_count(num_blocks: int, fraction: float) -> int:
    """How many of `num_blocks` become validation blocks when the data has no validation split."""
    return max(1, int(round(num_blocks * fraction))) if fraction > 0 and num_blocks > 1 else 0


def held_out_split(num_blocks: int, fraction: float) -> tuple[np.ndarray, np.ndarray]:
    ids = np.random.default_rng(HELD_OUT_SEED).permutation(num_blocks)
    n_val = held_out_count(num_blocks, fraction)
    return np.sort(ids[n_val:]), np.sort(ids[:n_val])


def memmap(path: Path, dtype) -> np.ndarray:
    if path.stat().st_size == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r")
