"""The front door of the data: `prepare_data` gives every rank the packed data of the run's source, whatever it is.
Text is tokenized once into the token cache (tokens.py: one process builds, the others wait and memory-map it); a
prepared directory or token files are opened as they are; fine-tuning rows become packed examples (sft/), preference
rows packed pairs (preference/); a mixture
opens each part alike; a stream is read as training goes (streaming.py); --dummy_data makes random blocks. Packing
and the order the blocks are read in are blocks.py's.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from model_utils.config.settings import TrainConfig
from model_utils.core.problems import Problem
from model_utils.data.blocks import PackedData, PackedTokens, ShardedTokens, held_out_split, memmap
from model_utils.data.errors import DataError
from model_utils.data.mixture import mix
from model_utils.data.preference.cache import open_pair_source
from model_utils.data.preference.formats import PREFERENCE
from model_utils.data.sft.cache import open_sft_source
from model_utils.data.sft.formats import FORMATS
from model_utils.data.sources import MANIFEST, DataSource, resolve_source, with_dataset
from model_utils.data.streaming import open_stream
from model_utils.data.vision.cache import open_vision_source
from model_utils.data.vision.formats import VISION
from model_utils.data.tokens import cache_dir_for, check_token_ids, ensure_token_cache, token_dtype, tokenizer_identity


def open_packed(cfg: TrainConfig, out_dir: Path, seq_len: int) -> PackedData:
    meta = json.loads((out_dir / "meta.json").read_text())
    dtype = np.dtype(meta["dtype"])
    validation = memmap(out_dir / "validation.bin", dtype) if (out_dir / "validation.bin").exists() else None
    return packed_blocks(memmap(out_dir / "train.bin", dtype), validation, cfg.validation_fraction, seq_len,
                         f"{meta['documents']['train']} documents, {meta['tokens']['train']:,} tokens")


def packed_blocks(train_tokens, validation_tokens, validation_fraction: float, seq_len: int, what: str) -> PackedData:
    """Blocks of the training tokens, and validation blocks: the validation split's, else held out of training."""
    train = PackedTokens(train_tokens, seq_len)
    if validation_tokens is not None:
        val = PackedTokens(validation_tokens, seq_len)
        train_ids, val_ids = np.arange(train.num_blocks), np.arange(val.num_blocks)
    else:
        val = train
        train_ids, val_ids = held_out_split(train.num_blocks, validation_fraction)
    desc = f"{what} -> {len(train_ids):,} training blocks of {seq_len} (+{len(val_ids):,} validation)"
    return PackedData(train, train_ids, val, val_ids, desc)


def open_prepared(cfg: TrainConfig, source: DataSource, tokenizer, seq_len: int) -> PackedData:
    """Memory-map the shards of a model_utils.prepare directory (nothing is copied: the time does not grow with the
    corpus). The shards of a split form one token stream in the manifest's order, and blocks span shard boundaries,
    so the blocks are those of the same documents tokenized by the trainer itself. The tokenizer that prepared them
    must be this run's."""
    folder = Path(source.location)
    manifest = json.loads((folder / MANIFEST).read_text())
    prepared_with, ours = manifest["tokenizer"]["identity"], tokenizer_identity(tokenizer)
    if prepared_with != ours:
        raise DataError(Problem(
            "--dataset", str(folder / MANIFEST),
            f"was prepared with tokenizer {manifest['tokenizer'].get('name')} (identity {prepared_with[:12]}), and "
            f"this run's tokenizer {tokenizer.name_or_path} has identity {ours[:12]}: the token ids would mean other "
            "text", f"train with --tokenizer {manifest['tokenizer'].get('name')}, or prepare the data again with "
            f"this run's tokenizer: python -m model_utils.prepare --dataset {manifest['dataset']} --tokenizer "
            f"{tokenizer.name_or_path} --output NEW_DIR"))
    dtype = np.dtype(manifest["dtype"])
    splits: dict[str, list] = {}
    for entry in manifest["shards"]:
        path = folder / entry["file"]
        size = path.stat().st_size if path.exists() else -1
        if size < entry["tokens"] * dtype.itemsize:
            raise DataError(Problem("--dataset", str(path), "is missing" if size < 0 else
                                    f"holds {size} bytes, fewer than the manifest's {entry['tokens']} tokens",
                                    "copy the prepared directory again, or prepare it again"))
        splits.setdefault(entry["split"], []).append(memmap(path, dtype)[:entry["tokens"]])
    validation = ShardedTokens(splits["validation"], dtype) if "validation" in splits else None
    return packed_blocks(ShardedTokens(splits["train"], dtype), validation, cfg.validation_fraction, seq_len,
                         f"prepared {folder}: {manifest['documents']['train']:,} documents, "
                         f"{manifest['tokens']['train']:,} tokens in {len(splits['train'])} shards")


def open_token_arrays(cfg: TrainConfig, source: DataSource, tokenizer, seq_len: int) -> PackedData:
    """`.npy` token files (one 1-D integer array each, in name order): one token stream as it is (no EOS added),
    memory-mapped; every id is checked against the tokenizer."""
    arrays = []
    for path in source.files:
        try:
            tokens = np.load(path, mmap_mode="r")
        except (ValueError, OSError) as e:
            raise DataError(Problem("--dataset", path, f"is not a readable .npy array ({e})",
                                    "write token ids with numpy.save")) from e
        if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
            raise DataError(Problem("--dataset", path, f"holds a {tokens.ndim}-D {tokens.dtype} array",
                                    "save the token ids as one 1-D integer array per file"))
        check_token_ids(tokens, len(tokenizer), "--dataset", path)
        arrays.append(tokens)
    stream = ShardedTokens(arrays) if len(arrays) > 1 else arrays[0]
    return packed_blocks(stream, None, cfg.validation_fraction, seq_len,
                         f"token files {source.location}: {len(stream):,} tokens in {len(arrays)} file(s)")


DUMMY_VALIDATION_FRACTION = 0.1


def dummy_packed(num_blocks: int, seq_len: int, vocab_size: int, seed: int) -> PackedData:
    """Random tokens: a smoke test that needs no dataset (the loss should sit near ln(vocab))."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab_size, size=num_blocks * seq_len + 1, dtype=np.int64).astype(token_dtype(vocab_size))
    packed = PackedTokens(tokens, seq_len)
    train_ids, val_ids = held_out_split(packed.num_blocks, DUMMY_VALIDATION_FRACTION)
    return PackedData(packed, train_ids, packed, val_ids, f"dummy data: {num_blocks} random blocks of {seq_len}")


def prepare_data(cfg: TrainConfig, tokenizer, seq_len: int, dist, log=print, source: DataSource | None = None,
                 seed: int = 0, data_format: str | None = None, processor=None) -> PackedData:
    """The run's packed data on every rank. Prepared directories and token files are memory-mapped by each rank; raw
    data are tokenized once into the token cache (ensure_token_cache) while the other ranks wait on its files; a
    mixture does either for each part; a stream (--streaming) is read by each rank as it trains (data/streaming.py).
    `source`: what --dataset means, as the run's plan resolved it (resolved here where not given); `seed`: the run's
    --seed (random blocks, a mixture's draw); `data_format`: a fine-tuning format (data.sft.formats.resolve_data_format)
    packs examples with their labels (data.sft.cache.open_sft_source) instead, VISION rows with images with a
    vision-language model's `processor` (data.vision.cache.open_vision_source)."""
    if cfg.dummy_data:
        return dummy_packed(cfg.dummy_data, seq_len, len(tokenizer), seed)
    source = source or resolve_source(cfg)
    if source.kind == "stream":
        return open_stream(cfg, source, tokenizer, seq_len, dist, log, seed)

    if data_format == VISION:
        return open_vision_source(cfg, source, processor, seq_len, dist, log)
    if data_format in FORMATS:
        return open_sft_source(cfg, source, tokenizer, seq_len, data_format, dist, log)
    if data_format == PREFERENCE:  # pairs in blocks of seq_len positions (data.preference.packing.pair_block_len)
        return open_pair_source(cfg, source, tokenizer, seq_len, dist, log)
    if source.kind == "mixture":
        parts = [(part, weight, open_source(with_dataset(cfg, part.location), part, tokenizer, seq_len, dist, log))
                 for part, weight in source.parts]
        return mix(parts, seed, seq_len)
    return open_source(cfg, source, tokenizer, seq_len, dist, log)


def open_source(cfg: TrainConfig, source: DataSource, tokenizer, seq_len: int, dist, log=print) -> PackedData:
    if source.kind == "prepared":
        return open_prepared(cfg, source, tokenizer, seq_len)
    if source.kind == "npy":
        return open_token_arrays(cfg, source, tokenizer, seq_len)
    out_dir = cache_dir_for(cfg, source, tokenizer)
    ensure_token_cache(cfg, source, tokenizer, out_dir, dist, log)
    return open_packed(cfg, out_dir, seq_len)


OPENED_WITHOUT_TOKENIZING = ("prepared", "npy", "mixture")


def describe_without_tokenizing(cfg: TrainConfig, source: DataSource, tokenizer,
                                seq_len: int) -> tuple[str, int | None]:
    """For the preflight: the data line and the training blocks of a prepared directory, token files or a mixture,
    opened as the run opens them (memory maps: nothing is read whole); a mixture's raw parts count where their token
    cache is built, else the blocks are unknown (None). Raises DataError as the run would."""
    if source.kind != "mixture":
        data = open_source(cfg, source, tokenizer, seq_len, dist=None)
        return f"data: {data.description}", len(data.train_ids)
    blocks, parts = 0, []
    for part, weight in source.parts:
        view = with_dataset(cfg, part.location)
        if part.kind in ("prepared", "npy"):
            data = open_source(view, part, tokenizer, seq_len, dist=None)
        elif (cache_dir_for(view, part, tokenizer) / "meta.json").exists():
            data = open_packed(view, cache_dir_for(view, part, tokenizer), seq_len)
        else:
            parts.append(f"{part.location} (weight {weight}, tokenized when the run starts)")
            blocks = None
            continue
        parts.append(f"{part.location} (weight {weight}, {len(data.train_ids):,} training blocks)")
        blocks = None if blocks is None else blocks + len(data.train_ids)
    return f"data: mixture of {len(parts)}: " + "; ".join(parts), blocks


