"""The packed pairs of a preference source, cached as fine-tuning examples are (data.sft.cache): encoded and packed
once by global rank 0 while the other ranks wait on its files, keyed by the source, the tokenizer, the chat template
and max_length, then memory-mapped by every rank with the held-out blocks apart.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from model_utils.config.preference import max_length_of, pair_block_len
from model_utils.core.problems import Problem
from model_utils.data.blocks import PackedData
from model_utils.data.errors import DataError
from model_utils.data.preference.encode import PairEncoder
from model_utils.data.preference.formats import check_pair_rows, is_messages
from model_utils.data.preference.packing import PackedPairs, PairStats, pack_pairs
from model_utils.data.sft.cache import build_once, open_splits, sft_cache_root, source_key, split_arrays, write_split
from model_utils.data.sft.encode import encode_all
from model_utils.data.sft.formats import resolve_chat_template
from model_utils.data.tokens import tokenizer_identity

SPLIT_FILES = ("inputs", "targets", "positions", "pair_offsets")


@dataclass
class PairSettings:
    """What the packed pairs depend on besides the rows and the tokenizer (part of the cache key)."""

    max_length: int  # tokens of one sequence, prompt and answer (TRL's max_length: --seq_len)
    validation_fraction: float = 0.01  # held-out blocks when the data has no validation split


def pair_cache_dir(root: Path, source_identity: str, tokenizer, settings: PairSettings) -> Path:
    template, _ = resolve_chat_template(tokenizer)
    parts = [source_identity, tokenizer_identity(tokenizer), hashlib.sha256(template.encode()).hexdigest(),
             "preference", str(settings.max_length)]
    return Path(root) / "preference" / hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def build_pair_files(splits: dict, tokenizer, settings: PairSettings, out_dir: Path, source: str, log=print,
                     workers: int = 1) -> dict:
    """Check every row of each split (`{"train": rows, "validation": rows or None}`), then encode and pack each and
    write <split>.{inputs,targets,positions,pair_offsets}.bin and meta.json (last: it marks a complete entry)."""
    splits = {split: rows for split, rows in splits.items() if rows is not None}
    for split, rows in splits.items():  # every row of every split checked before any is tokenized
        check_pair_rows(rows, f"{source} ({split} split)")
    out_dir.mkdir(parents=True, exist_ok=True)
    meta: dict = {"max_length": settings.max_length, "splits": {}}
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    for split, rows in splits.items():
        encoder = PairEncoder(tokenizer, f"{source} ({split} split)")
        packed = pack_pairs(encode_all(rows, encoder, workers), settings.max_length, pad_id, len(tokenizer))
        if packed.stats.blocks == 0:
            raise DataError(Problem("--dataset", source, f"the {split} split holds no pair with an answer token "
                                    f"within --seq_len {settings.max_length} tokens", "raise --seq_len, or shorten "
                                    "the prompts"))
        meta["splits"][split] = write_split(packed, SPLIT_FILES, out_dir, split)
        meta["format"] = encoder.describe(is_messages(rows[0]["chosen"]))
        log(f"data: {split}: {packed.stats.describe()}")
    (out_dir / "meta.json").write_text(json.dumps(meta, indent=1))
    return meta


def _open_split(out_dir: Path, split: str, meta: dict) -> PackedPairs:
    return PackedPairs(*split_arrays(out_dir, split, meta, SPLIT_FILES), seq_len=pair_block_len(meta["max_length"]))


def open_pairs(out_dir: Path, validation_fraction: float = PairSettings.validation_fraction) -> PackedData:
    """The packed pairs as the loop reads PackedData: train/val are PackedPairs (val: the validation split's, else
    the held-out blocks of the training split, whose pairs keep their numbers)."""
    meta, (train, train_ids, val, val_ids) = open_splits(out_dir, validation_fraction, _open_split)
    stats = PairStats(**meta["splits"]["train"]["stats"])
    description = (f"{meta['format']}: {stats.describe()}; {len(train_ids):,} training blocks "
                   f"(+{len(val_ids):,} validation)")
    return PackedData(train, train_ids, val, val_ids, description)


def pair_cache_of(cfg, source, tokenizer, block_len: int) -> Path:
    """The cache directory of this source's pairs in blocks of `block_len` positions."""
    settings = PairSettings(max_length_of(block_len), cfg.validation_fraction)
    return pair_cache_dir(sft_cache_root(cfg), source_key(source, cfg), tokenizer, settings)


def open_pair_source(cfg, source, tokenizer, block_len: int, dist, log=print) -> PackedData:
    """The packed pairs on every rank: global rank 0 encodes and packs them into the cache (data.tokens'
    protocol: the other ranks wait on its files), then every rank memory-maps them."""
    settings = PairSettings(max_length_of(block_len), cfg.validation_fraction)
    out_dir = pair_cache_of(cfg, source, tokenizer, block_len)
    build_once(cfg, source, tokenizer, out_dir, dist, log, "pairs",
               lambda splits, workers: build_pair_files(splits, tokenizer, settings, out_dir, source.location, log,
                                                        workers))
    return open_pairs(out_dir, cfg.validation_fraction)
