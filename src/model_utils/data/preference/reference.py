"""The reference's log-probabilities of every pair, stored beside the packed pairs they score.

A directory per reference (`reference_dir`: keyed by what the numbers depend on: the model at step 0, its precision
and the packed pairs) under the pairs' cache entry holds, per split file of the pairs, `<split>.npy`: one row per pair
(in the pairs' numbering, data.preference.packing), the summed log-probability of its chosen and of its rejected
answer, float64; meta.json is written last (its presence marks a complete entry) with the digest a checkpoint
records. The rows are computed by every rank and gathered (train.reference); rank 0 writes them here.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np


def model_files_identity(model: str) -> list | None:
    """The names, sizes and times of a model directory's config and weight files (None for a preset or a hub id):
    other weights under the same path make another reference."""
    folder = Path(model)
    if not folder.is_dir():
        return None
    files = sorted(p for p in folder.iterdir() if p.suffix in (".json", ".safetensors", ".bin") and p.is_file())
    return [(p.name, p.stat().st_size, int(p.stat().st_mtime)) for p in files]


def reference_dir(pairs_dir: Path, identity: dict) -> Path:
    key = hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return Path(pairs_dir) / f"reference-{key}"


@dataclass
class StoredReference:
    """The reference's log-probabilities of each split's pairs (pairs x 2: chosen, rejected) and their digest."""

    splits: dict
    digest: str

    def rows(self, split: str, pair_numbers) -> np.ndarray:
        return self.splits[split][np.asarray(pair_numbers, dtype=np.int64)]


def merged_reference(parts: list[dict], pairs: dict[str, int]) -> StoredReference:
    """The ranks' rows (`parts`: per rank, per split, rows of pair number, chosen, rejected) as one array per split
    (`pairs`: its pair count). A pair no rank computed is the caller's error: it raises."""
    splits, digest = {}, hashlib.sha256()
    for split, count in sorted(pairs.items()):
        merged = np.full((count, 2), np.nan)
        for part in parts:
            rows = np.asarray(part.get(split, np.zeros((0, 3))), dtype=np.float64).reshape(-1, 3)
            merged[rows[:, 0].astype(np.int64)] = rows[:, 1:]
        missing = np.flatnonzero(np.isnan(merged).any(axis=1))
        if len(missing):
            raise RuntimeError(f"the reference's log-probabilities of {len(missing)} {split} pairs were not computed")
        splits[split] = merged
        digest.update(merged.tobytes())
    return StoredReference(splits, digest.hexdigest()[:16])


def write_reference(directory: Path, reference: StoredReference, identity: dict) -> None:
    """Each split's array, then meta.json, each written under a temporary name and renamed."""
    directory.mkdir(parents=True, exist_ok=True)
    for split, array in reference.splits.items():
        tmp = directory / f"{split}.tmp-{os.getpid()}.npy"
        np.save(tmp, array)
        os.replace(tmp, directory / f"{split}.npy")
    meta = {"identity": identity, "pairs": {s: len(a) for s, a in reference.splits.items()},
            "digest": reference.digest}
    tmp = directory / f"meta.json.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(meta, indent=1, default=str))
    os.replace(tmp, directory / "meta.json")


def read_reference(directory: Path) -> StoredReference | None:
    """The complete entry at `directory`, None where there is none."""
    meta_file = Path(directory) / "meta.json"
    if not meta_file.exists():
        return None
    meta = json.loads(meta_file.read_text())
    return StoredReference({split: np.load(Path(directory) / f"{split}.npy") for split in meta["pairs"]},
                           meta["digest"])
