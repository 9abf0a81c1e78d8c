"""The packed examples of a dataset with images, cached as text examples are (data.sft.cache): checked, encoded and
packed once by one rank while the others wait on its files, keyed by the source, the processor (tokenizer, chat
template, image processor with its pixel bounds) and the settings, then memory-mapped by every rank. The cache holds
token ids, positions and the images' file names; images a dataset holds itself are written there as files.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from model_utils.core.problems import Problem
from model_utils.data.blocks import PackedData
from model_utils.data.errors import DataError
from model_utils.data.sft.cache import (build_once, held_out_blocks, sft_cache_root, source_key, split_arrays,
                                        write_split)
from model_utils.data.sft.encode import encode_all
from model_utils.data.vision.encode import VisionEncoder
from model_utils.data.vision.formats import vision_format
from model_utils.data.vision.images import ImageFiles
from model_utils.data.vision.packing import PackedVisionExamples, PixelReader, VisionStats, pack_vision_examples
from model_utils.data.vision.processor import image_token, processor_identity

SPLIT_FILES = ("inputs", "targets", "positions", "mrope", "images", "block_images")


def vision_cache_dir(root: Path, source_identity: str, processor, seq_len: int, fmt: str,
                     train_on_prompts: bool) -> Path:
    parts = [source_identity, processor_identity(processor), fmt, str(train_on_prompts), str(seq_len)]
    return Path(root) / "vision" / hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def data_dir_of(source) -> str | None:
    """Where a source's relative image paths start: the directory of its (first) data file, or a saved dataset's."""
    if source.files:
        return str(Path(source.files[0]).parent)
    return source.location if Path(source.location).is_dir() else None


def build_vision_files(splits: dict, processor, seq_len: int, requested_format: str, train_on_prompts: bool,
                       out_dir: Path, source, log=print, workers: int = 1) -> dict:
    """Check, encode and pack each split ({"train": rows, "validation": rows or None}) and write its arrays, the image
    files (images.json) and meta.json (last: it marks a complete entry). Returns the meta."""
    splits = {split: rows for split, rows in splits.items() if rows is not None}
    files = ImageFiles(data_dir_of(source), out_dir / "images")
    pad_id = processor.tokenizer.pad_token_id
    pad_id = pad_id if pad_id is not None else processor.tokenizer.eos_token_id
    _, token_id = image_token(processor)
    out_dir.mkdir(parents=True, exist_ok=True)
    meta: dict = {"seq_len": seq_len, "splits": {}, "image_token_id": token_id}
    fmt = None
    for split, rows in splits.items():
        where = f"{source.location} ({split} split)"
        columns = list(getattr(rows, "column_names", None) or (next(iter(rows), None) or {}).keys())
        fmt = fmt or vision_format(columns, requested_format, where)
        encoder = VisionEncoder(processor, fmt, files, train_on_prompts, where)
        packed = pack_vision_examples(encode_all(rows, encoder, workers), seq_len, pad_id, len(processor.tokenizer),
                                      token_id, where)
        if packed.stats.blocks == 0:
            raise DataError(Problem("--dataset", source.location, f"the {split} split holds no example with a token "
                                    "carrying loss", "check the data (answers present)"))
        meta["splits"][split] = write_split(packed, SPLIT_FILES, out_dir, split)
        meta["splits"][split]["image_files"] = packed.image_files
        meta["format"] = encoder.describe()
        log(f"data: {split}: {packed.stats.describe()}")
    (out_dir / "meta.json").write_text(json.dumps(meta, indent=1))
    return meta


def open_split(out_dir: Path, split: str, meta: dict, reader: PixelReader) -> PackedVisionExamples:
    import numpy as np

    present = [name for name in SPLIT_FILES if (out_dir / f"{split}.{name}.bin").stat().st_size]
    arrays = dict(zip(present, split_arrays(out_dir, split, meta, tuple(present))))  # an empty file maps to nothing
    inputs, targets, positions, mrope, images, block_images = (
        arrays.get(name, np.zeros(0, dtype=np.dtype(meta["splits"][split]["dtypes"][name]))) for name in SPLIT_FILES)
    return PackedVisionExamples(inputs, targets, positions, mrope.reshape(3, -1), images, block_images,
                                meta["splits"][split]["image_files"], meta["seq_len"], meta["image_token_id"], reader)


def open_vision(out_dir: Path, processor, validation_fraction: float) -> PackedData:
    """The packed data as the loop reads PackedData: train/val are PackedVisionExamples reading their images with
    `processor`; without a validation split, held-out blocks of the training split."""
    import numpy as np

    meta = json.loads((out_dir / "meta.json").read_text())
    reader = PixelReader(processor)
    train = open_split(out_dir, "train", meta, reader)
    if "validation" in meta["splits"]:
        val = open_split(out_dir, "validation", meta, reader)
        train_ids, val_ids = np.arange(train.num_blocks), np.arange(val.num_blocks)
    else:
        val = train
        train_ids, val_ids = held_out_blocks(train.num_blocks, validation_fraction)
    stats = VisionStats(**meta["splits"]["train"]["stats"])
    description = (f"vision-language data ({meta['format']}): {stats.describe()}; {len(train_ids):,} training "
                   f"blocks (+{len(val_ids):,} validation)")
    return PackedData(train, train_ids, val, val_ids, description)


def open_vision_source(cfg, source, processor, seq_len: int, dist, log=print) -> PackedData:
    """The packed data with images on every rank: one rank encodes and packs them into the cache (data.sft.cache's
    build_once), then every rank memory-maps them."""
    out_dir = vision_cache_dir(sft_cache_root(cfg), source_key(source, cfg), processor, seq_len, cfg.data_format,
                               cfg.train_on_prompts)
    build_once(cfg, source, processor.tokenizer, out_dir, dist, log, "examples",
               lambda splits, workers: build_vision_files(splits, processor, seq_len, cfg.data_format,
                                                          cfg.train_on_prompts, out_dir, source, log, workers))
    return open_vision(out_dir, processor, cfg.validation_fraction)
