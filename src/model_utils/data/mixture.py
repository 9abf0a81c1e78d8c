"""Mixtures: several datasets with weights, trained as one.

    --dataset "a.jsonl:0.7,prepared_dir:0.3"       or      --dataset mixture.json
    mixture.json: {"mixture": [{"dataset": "a.jsonl", "weight": 0.7}, {"dataset": "prepared_dir", "weight": 0.3}]}

Each part is opened as --dataset alone would open it (raw data through the token cache, a prepared directory, token
files). An epoch of the mixture has as many training blocks as all parts together; part c gets the share w_c / sum(w)
of them (largest-remainder rounding). A part whose share exceeds its blocks contributes all of them as many whole times
as fit plus a subset of the rest; a smaller share is a subset. The subsets are drawn by --seed, once for the run, so
the mixture's block list is fixed and BlockOrder visits it as any dataset's: the same order for a seed at any world
size, and a resume continues exactly. Validation blocks are every part's validation blocks, unweighted. The two
--dataset forms above are read by sources.parse_mixture, with what --dataset names.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from model_utils.core.problems import Problem
from model_utils.data.blocks import PackedData, ShardedTokens
from model_utils.data.errors import DataError

SELECTION_STREAM = 7  # the mixture's subsets use their own random stream, apart from the block order's


def share_counts(weights: list[float], total: int) -> list[int]:
    """`total` split in proportion to `weights`, rounded by largest remainder (the counts add up to `total`)."""
    exact = np.asarray(weights, dtype=np.float64) / sum(weights) * total
    counts = np.floor(exact).astype(np.int64)
    for i in np.argsort(-(exact - counts), kind="stable")[: total - int(counts.sum())]:
        counts[i] += 1
    return counts.tolist()


class MixedBlocks:
    """The blocks of several parts under one numbering: part c's block j is id offsets[c] + j."""

    def __init__(self, parts: list, note: str = ""):
        self.parts = parts
        self.seq_len = parts[0].seq_len
        self.offsets = np.zeros(len(parts) + 1, dtype=np.int64)
        np.cumsum([p.num_blocks for p in parts], out=self.offsets[1:])
        self.num_blocks = int(self.offsets[-1])
        # What a checkpoint's data identity digests: every part's tokens, with the weights and selection as note.
        self.tokens = ShardedTokens([p.tokens for p in parts], note=note)

    def block(self, i: int) -> np.ndarray:
        part = int(np.searchsorted(self.offsets, i, side="right")) - 1
        return self.parts[part].block(int(i) - int(self.offsets[part]))

    def batch(self, indices) -> np.ndarray:
        return np.stack([self.block(i) for i in indices]).astype(np.int64)


def mix(parts: list, seed: int, seq_len: int):
    """One PackedData from (source, weight, PackedData) triples: the training block list with each part's share,
    drawn by `seed`; the description states the shares realised."""
    for source, _, data in parts:
        if len(data.train_ids) == 0:
            raise DataError(Problem("--dataset", source.location, f"gives no training block of {seq_len} tokens",
                                    "use more data in this part, a smaller --seq_len, or leave the part out"))
    sizes = [len(data.train_ids) for _, _, data in parts]
    targets = share_counts([w for _, w, _ in parts], sum(sizes))
    note = json.dumps({"weights": [w for _, w, _ in parts], "blocks": targets, "seed": seed})
    train = MixedBlocks([data.train for _, _, data in parts], note)
    val = MixedBlocks([data.val for _, _, data in parts])
    train_ids, val_ids, lines = [], [], []
    for c, ((source, weight, data), size, target) in enumerate(zip(parts, sizes, targets)):
        ids = np.asarray(data.train_ids, dtype=np.int64) + train.offsets[c]
        whole, rest = divmod(target, size)
        rng = np.random.default_rng([seed, SELECTION_STREAM, c])
        train_ids += [ids] * whole + [ids[np.sort(rng.permutation(size)[:rest])]]
        val_ids.append(np.asarray(data.val_ids, dtype=np.int64) + val.offsets[c])
        lines.append(f"{Path(source.location).name} {100 * target / max(1, sum(targets)):.1f}% (weight "
                     f"{weight / sum(w for _, w, _ in parts):.3f}; {target:,} blocks per epoch from its {size:,}, "
                     f"{target / size:.2f} passes)")
    train_ids, val_ids = np.concatenate(train_ids), np.concatenate(val_ids)
    description = (f"mixture of {len(parts)}: " + ", ".join(lines) + f" -> {len(train_ids):,} training blocks of "
                   f"{seq_len} (+{len(val_ids):,} validation)")
    return PackedData(train, train_ids, val, val_ids, description)
