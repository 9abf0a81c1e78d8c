"""A dataset of your own, `--dataset FILE.py:FUNCTION`: FUNCTION(settings) returns a map-style dataset (len and
indexing), or a mapping {"train": dataset, "validation": dataset (optional), "collate": function (optional)}. The
trainer reads it as it reads packed blocks: item i is block i, `BlockOrder` gives each rank its disjoint share of every
micro-batch in the seed's order, and a checkpoint's data position resumes at the exact item. A micro-batch is
collate([items]) (default: torch's default_collate), its tensors moved to the GPU and given to the model's forward as
keyword arguments. Without a validation set, --validation_fraction of the items is held out (the same ones on every
world size and seed).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np

from model_utils.core.problems import Problem
from model_utils.core.user_code import load_function
from model_utils.data.blocks import held_out_split
from model_utils.data.errors import DataError, OneRankDataError

FIX_RETURN = ("return a map-style dataset (with __len__ and __getitem__), or {'train': dataset, 'validation': "
              "dataset, 'collate': function}")


@dataclass(frozen=True)
class DataSettings:
    """What a dataset function receives."""

    args: dict = field(default_factory=dict)  # --data_args, with the stage's own data_args merged over them
    tokenizer: object = None  # the run's tokenizer
    seq_len: int | None = None  # --seq_len
    seed: int = 0  # --seed
    stage: str | None = None  # the curriculum stage these data are for (None: no stages)


@dataclass
class UserBatch:
    """A collated micro-batch: the keyword arguments of the model's forward, and the items it holds."""

    inputs: dict
    items: list


class UserItems:
    """Items of the user's dataset by index, collated into micro-batches (`batch`, as PackedTokens.batch is read)."""

    def __init__(self, dataset, collate, spec: str, split: str):
        self.dataset, self.collate, self.spec, self.split = dataset, collate, spec, split

    def __len__(self) -> int:
        return len(self.dataset)

    def batch(self, indices) -> UserBatch:
        items = [int(i) for i in indices]
        try:
            rows = [self.dataset[i] for i in items]
        except Exception as e:  # the user's dataset: found on this rank alone, mid-run
            raise OneRankDataError(Problem("--dataset", self.spec, f"{self.split} items {items} could not be read: "
                                           f"{type(e).__name__}: {e}", "fix the dataset's __getitem__ for these "
                                                                        "items")) from e
        try:
            inputs = self.collate(rows)
        except Exception as e:
            raise OneRankDataError(collate_problem(self.spec, self.split, items, e)) from e
        if not isinstance(inputs, dict):
            raise OneRankDataError(Problem("--dataset", self.spec, f"its collate returned a {type(inputs).__name__} "
                                           f"for {self.split} items {items}, not a mapping",
                                           "collate into a dict of the forward's keyword arguments"))
        return UserBatch(inputs, items)


def collate_problem(spec: str, split: str, items: list, error: Exception) -> Problem:
    return Problem("--dataset", spec, f"its collate cannot batch {split} items {items}: {type(error).__name__}: "
                                      f"{error}", "make every item collate with the others (the same keys, tensors of "
                                                  "one shape, or a collate of your own that pads them)")


@dataclass
class UserData:
    """The run's data from a dataset of your own, as build.py reads packed data: train/val items and their ids."""

    train: UserItems
    train_ids: np.ndarray
    val: UserItems
    val_ids: np.ndarray
    description: str
    seq_len: int = 1  # positions an item counts for in the logged throughput (--seq_len)
    identity: dict = field(default_factory=dict)

    @property
    def train_tokens(self) -> int:
        return len(self.train_ids) * self.seq_len


def load_user_data(spec: str, settings: DataSettings, validation_fraction: float) -> UserData:
    """The data FUNCTION(settings) returns, checked: a dataset with items, the first of which collates; DataError
    with the problem otherwise (every rank calls this alike and finds the same)."""
    import torch.utils.data

    function, problem = load_function(spec, "dataset")
    if problem is not None:
        raise DataError(problem)
    try:
        returned = function(settings)
    except Exception as e:
        raise DataError(Problem("--dataset", spec, f"calling it raised {type(e).__name__}: {e}",
                                "fix the function (it receives settings.args, .tokenizer, .seq_len, .seed, .stage)")) from e
    parts = returned if isinstance(returned, dict) else {"train": returned}
    unknown = sorted(set(parts) - {"train", "validation", "collate"})
    train, validation = parts.get("train"), parts.get("validation")
    collate = parts.get("collate") or torch.utils.data.default_collate
    for name, dataset in (("train", train), ("validation", validation)):
        if dataset is None and name == "validation":
            continue
        if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
            raise DataError(Problem("--dataset", spec, f"its {name} set is a {type(dataset).__name__}, not a "
                                                       "map-style dataset", FIX_RETURN))
    if unknown or not callable(collate):
        raise DataError(Problem("--dataset", spec, f"returned keys {unknown}" if unknown else "its collate is not "
                                "a function", FIX_RETURN))
    if len(train) == 0:
        raise DataError(Problem("--dataset", spec, "its train set is empty", "return a dataset with items"))
    train_items = UserItems(train, collate, spec, "train")
    if validation is not None:
        val_items, train_ids, val_ids = UserItems(validation, collate, spec, "validation"), \
            np.arange(len(train)), np.arange(len(validation))
        held = f"{len(validation):,} validation items"
    else:
        train_ids, val_ids = held_out_split(len(train), validation_fraction)
        val_items = train_items
        held = f"{len(val_ids):,} held out (--validation_fraction {validation_fraction:g})"
    try:  # every rank reads the same first items: a problem found here is found by all of them
        first = train_items.batch([int(i) for i in train_ids[:2]])
    except OneRankDataError as e:
        raise DataError(e.problem) from e
    digest = hashlib.sha256(b"".join(_bytes(k, v) for k, v in sorted(first.inputs.items()))).hexdigest()[:16]
    stage = f" (stage {settings.stage})" if settings.stage else ""
    description = (f"{spec}{stage}: {len(train_ids):,} training items, {held}; a micro-batch's keys: "
                   f"{', '.join(sorted(first.inputs))}")
    identity = {"dataset": spec, "data_args": settings.args, "items": len(train_ids), "fingerprint": digest}
    return UserData(train_items, np.asarray(train_ids, dtype=np.int64), val_items, np.asarray(val_ids, dtype=np.int64),
                    description, max(settings.seq_len or 1, 1), identity)


def _bytes(key: str, value) -> bytes:
    """A collated value's content for the data's fingerprint: a tensor's shape and bytes, else its repr."""
    import torch

    if isinstance(value, torch.Tensor):
        tensor = value.detach().cpu().contiguous().reshape(-1)
        return key.encode() + repr(tuple(value.shape)).encode() + tensor.view(torch.uint8).numpy().tobytes()
    return key.encode() + repr(value).encode()
