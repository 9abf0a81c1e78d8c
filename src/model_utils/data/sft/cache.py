"""The packed examples of a fine-tuning source, cached: encoded and packed once by global rank 0 (data.tokens'
protocol: the other ranks wait on its files), keyed by the source, the tokenizer and the settings, then memory-mapped
by every rank with the held-out blocks apart.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from model_utils.core.problems import Problem
from model_utils.data.blocks import HELD_OUT_SEED, PackedData, held_out_count
from model_utils.data.chat_corpus import split_files
from model_utils.data.corpus import default_cache_root
from model_utils.data.errors import DataError
from model_utils.data.loading import hf_cache_dir, load_splits
from model_utils.data.sft.encode import ExampleEncoder, check_rows, encode_all
from model_utils.data.sft.formats import detect_format, resolve_chat_template
from model_utils.data.sft.packing import PackedExamples, PackingStats, pack_examples
from model_utils.data.sources import resolve_source
from model_utils.data.tokens import ensure_token_cache, tokenizer_identity, tokenizing_processes


# --------------------------------------------------------------------------------------------------------------------
# The cache: build once (one process), open memory-mapped everywhere
# --------------------------------------------------------------------------------------------------------------------
@dataclass
class SFTSettings:
    """What the packed SFT data depends on besides the rows and the tokenizer (part of the cache key)."""

    seq_len: int
    data_format: str = "auto"  # --data_format
    train_on_prompts: bool = False  # --train_on_prompts
    validation_fraction: float = 0.01  # held-out blocks when the data has no validation split


def sft_cache_dir(root: Path, source_identity: str, tokenizer, settings: SFTSettings) -> Path:
    """The cache directory of this data packed with this tokenizer, template and settings."""
    template, _ = resolve_chat_template(tokenizer)
    parts = [source_identity, tokenizer_identity(tokenizer), hashlib.sha256(template.encode()).hexdigest(),
             settings.data_format, str(settings.train_on_prompts), str(settings.seq_len)]
    return Path(root) / "sft" / hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def write_array(array: np.ndarray, path: Path) -> None:
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    array.tofile(tmp)
    os.replace(tmp, path)


def write_split(packed, names: tuple[str, ...], out_dir: Path, split: str) -> dict:
    """One split's packed arrays `names` (attributes of `packed`) as `{split}.{name}.bin`; its meta.json entry: the
    packing's stats and each array's dtype (split_arrays reads them back)."""
    for name in names:
        write_array(getattr(packed, name), out_dir / f"{split}.{name}.bin")
    return {"stats": asdict(packed.stats), "dtypes": {name: getattr(packed, name).dtype.name for name in names}}


def split_arrays(out_dir: Path, split: str, meta: dict, names: tuple[str, ...]) -> list[np.memmap]:
    """One split's arrays `names` as write_split left them, mapped read-only."""
    dtypes = meta["splits"][split]["dtypes"]
    return [np.memmap(out_dir / f"{split}.{name}.bin", dtype=np.dtype(dtypes[name]), mode="r") for name in names]


SPLIT_FILES = ("inputs", "targets", "positions")


def build_sft_files(splits: dict, tokenizer, settings: SFTSettings, out_dir: Path, source: str,
                    log=print, workers: int = 1) -> dict:
    """Check every row of each split, then encode (with `workers` processes: encode_all) and pack each
    (`{"train": rows, "validation": rows or None}`; rows: a datasets.Dataset, or a list of dicts whose first row names
    the columns) and write <split>.{inputs,targets,positions}.bin and meta.json (written last: it marks a complete
    entry). Returns the meta."""
    splits = {split: rows for split, rows in splits.items() if rows is not None}
    formats: dict[str, str] = {}
    for split, rows in splits.items():  # every row of every split checked before any is tokenized
        columns = list(getattr(rows, "column_names", None) or (next(iter(rows), None) or {}).keys())
        requested = next(iter(formats.values()), settings.data_format)  # the validation split: the train's format
        formats[split] = detect_format(columns, requested, f"{source} ({split} split)")
        check_rows(rows, formats[split], f"{source} ({split} split)")
    out_dir.mkdir(parents=True, exist_ok=True)
    meta: dict = {"seq_len": settings.seq_len, "splits": {}}
    for split, rows in splits.items():
        encoder = ExampleEncoder(tokenizer, formats[split], settings.train_on_prompts, f"{source} ({split} split)")
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        packed = pack_examples(encode_all(rows, encoder, workers), settings.seq_len, pad_id, len(tokenizer))
        if packed.stats.blocks == 0:
            raise DataError(Problem("--dataset", source, f"the {split} split holds no example with a token "
                                    "carrying loss", "check the data (answers present) or pass --train_on_prompts"))
        meta["splits"][split] = write_split(packed, SPLIT_FILES, out_dir, split)
        meta["format"] = encoder.describe()
        log(f"data: {split}: {packed.stats.describe()}")
    (out_dir / "meta.json").write_text(json.dumps(meta, indent=1))
    return meta


def _open_split(out_dir: Path, split: str, meta: dict) -> PackedExamples:
    return PackedExamples(*split_arrays(out_dir, split, meta, SPLIT_FILES), seq_len=meta["seq_len"])


def held_out_blocks(num_blocks: int, fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """(training block ids, validation block ids) when the data has no validation split; fixed by HELD_OUT_SEED."""
    ids = np.random.default_rng(HELD_OUT_SEED).permutation(num_blocks)
    n_val = held_out_count(num_blocks, fraction)
    return np.sort(ids[n_val:]), np.sort(ids[:n_val])


def open_sft(out_dir: Path, validation_fraction: float = SFTSettings.validation_fraction) -> PackedData:
    """The packed SFT data as the loop reads `PackedData`: train/val are PackedExamples, the blocks' ids, and the
    description for the run's data line (format, template, the statistics)."""
    meta, (train, train_ids, val, val_ids) = open_splits(out_dir, validation_fraction, _open_split)
    stats = PackingStats(**meta["splits"]["train"]["stats"])
    description = (f"fine-tuning data ({meta['format']}): {stats.describe()}; {len(train_ids):,} training blocks "
                   f"(+{len(val_ids):,} validation)")
    return PackedData(train, train_ids, val, val_ids, description)


def open_splits(out_dir: Path, validation_fraction: float, open_split) -> tuple[dict, tuple]:
    """(meta.json, (train, train block ids, validation, validation block ids)) of a cache entry: `open_split(out_dir,
    split, meta)` memory-maps a split; without a validation split, held-out blocks of the training split are it."""
    meta = json.loads((out_dir / "meta.json").read_text())
    train = open_split(out_dir, "train", meta)
    if "validation" in meta["splits"]:
        val = open_split(out_dir, "validation", meta)
        return meta, (train, np.arange(train.num_blocks), val, np.arange(val.num_blocks))
    train_ids, val_ids = held_out_blocks(train.num_blocks, validation_fraction)
    return meta, (train, train_ids, train, val_ids)


EMBEDDED_SPLIT_KINDS = ("embedded-chat", "embedded-preference", "embedded-vision")  # a train and a validation file


def load_sft_splits(source, cfg):
    """(train, validation or None) of a fine-tuning source: an embedded dataset's two files as its splits (the chats,
    their preference pairs), anything else as data.loading.load_splits reads it."""
    if source.kind not in EMBEDDED_SPLIT_KINDS:
        return load_splits(source, cfg)
    import datasets

    loaded = datasets.load_dataset("json", data_files=split_files(Path(source.location)), cache_dir=hf_cache_dir(cfg))
    splits = loaded["train"], loaded["validation"]
    if cfg.max_documents:  # the first N examples of each split
        splits = tuple(split.select(range(min(cfg.max_documents, len(split)))) for split in splits)
    return splits


def open_sft_source(cfg, source, tokenizer, seq_len: int, data_format: str, dist, log=print) -> PackedData:
    """The packed fine-tuning data on every rank: global rank 0 encodes and packs them into the cache
    (data.tokens.ensure_token_cache's protocol: the other ranks wait on its files), then every rank memory-maps
    them (open_sft)."""
    settings = SFTSettings(seq_len, data_format, cfg.train_on_prompts, cfg.validation_fraction)
    out_dir = sft_cache_dir(sft_cache_root(cfg), source_key(source, cfg), tokenizer, settings)
    build_once(cfg, source, tokenizer, out_dir, dist, log, "examples",
               lambda splits, workers: build_sft_files(splits, tokenizer, settings, out_dir, source.location, log,
                                                       workers))
    return open_sft(out_dir, cfg.validation_fraction)


def build_once(cfg, source, tokenizer, out_dir: Path, dist, log, counted: str, write_files) -> None:
    """The cache entry `out_dir` of a fine-tuning source's rows, built by one rank while the others wait on its files
    (data.tokens.ensure_token_cache): `write_files(splits, workers)` checks, encodes, packs and writes the splits and
    returns their meta, whose statistics count `counted` (examples, pairs) and tokens for the progress line."""

    def build(cfg, tokenizer, out_dir, log, source, progress=None):
        train, validation = load_sft_splits(source, cfg)
        if progress is not None:
            progress.set_total(len(train) + (len(validation) if validation is not None else 0))
        meta = write_files({"train": train, "validation": validation}, tokenizing_processes(cfg.num_proc))
        if progress is not None:
            rows = sum(split["stats"][counted] for split in meta["splits"].values())
            tokens = sum(split["stats"]["tokens"] for split in meta["splits"].values())
            progress.update(rows, tokens, rows)

    ensure_token_cache(cfg, source, tokenizer, out_dir, dist, log, build=build)


def source_key(source, cfg) -> str:
    """What the packed examples are made of: the source and, with --max_documents, how many of its rows."""
    return source.identity() + (f"|max_documents={cfg.max_documents}" if cfg.max_documents else "")


def sft_cache_root(cfg) -> Path:
    return Path(cfg.data_cache_dir) if cfg.data_cache_dir else default_cache_root()


def ensure_sft_cache(cfg, tokenizer, settings: SFTSettings, source=None, log=print) -> Path:
    """The cache directory of the fine-tuning data, built here where it is missing (one process, no other ranks:
    tools and tests; a run goes through open_sft_source). `source`: the resolved --dataset."""
    source = source or resolve_source(cfg)
    out_dir = sft_cache_dir(sft_cache_root(cfg), source_key(source, cfg), tokenizer, settings)
    if not (out_dir / "meta.json").exists():
        train, validation = load_sft_splits(source, cfg)
        build_sft_files({"train": train, "validation": validation}, tokenizer, settings, out_dir, source.location,
                        log, tokenizing_processes(cfg.num_proc))
    return out_dir
