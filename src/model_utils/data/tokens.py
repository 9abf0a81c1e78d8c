"""Tokenizing into the token cache: every document with an EOS after it, each split's ids written back to back into one
flat file (uint16 where the vocabulary fits), built once by global rank 0 while the other ranks wait on its files, and
identified by the tokenizer's digest and the source, so a change of either builds anew.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from model_utils.config.settings import TrainConfig
from model_utils.core.problems import Problem
from model_utils.data.corpus import default_cache_root
from model_utils.data.errors import DataError, PreparerLost
from model_utils.data.loading import load_splits
from model_utils.data.progress import (PreparationFailed, Progress, read_json, record_failure, wait_for_preparer,
                                       write_json_atomic)
from model_utils.data.sources import DataSource, resolve_source


# --------------------------------------------------------------------------------------------------------------------
# Tokenize and write the flat token file
# --------------------------------------------------------------------------------------------------------------------
def tokenizer_identity(tokenizer) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    body = backend.to_str() if backend is not None else f"{tokenizer.name_or_path}|{len(tokenizer)}"
    return hashlib.sha256(f"{body}|{tokenizer.eos_token_id}".encode()).hexdigest()


def token_dtype(vocab_size: int):
    return np.uint16 if vocab_size <= np.iinfo(np.uint16).max + 1 else np.uint32


def ends_with_eos(ids: list, eos: int) -> list:
    """Given token ids of one document (`input_ids` of pre-tokenized data): an EOS ends it, appended unless it is
    there already; an empty document stays empty."""
    return list(ids) if not ids or ids[-1] == eos else list(ids) + [eos]


def is_pretokenized(ds, text_column: str) -> bool:
    """Data without the text column but with `input_ids`: token ids used as they are."""
    return text_column not in ds.column_names and "input_ids" in ds.column_names


def tokenize_split(ds, tokenizer, text_column: str, num_proc: int | None, split: str):
    if is_pretokenized(ds, text_column):
        if len(ds) == 0:
            raise DataError(Problem("--dataset", split, "this split is empty", "point --dataset at data with documents"))
        eos = tokenizer.eos_token_id
        return ds.map(lambda batch: {"input_ids": [ends_with_eos(x or [], eos) for x in batch["input_ids"]]},
                      batched=True, batch_size=1000, remove_columns=ds.column_names, desc=f"taking {split}'s input_ids")
    if text_column not in ds.column_names:
        raise DataError(Problem("--text_column", text_column, f"the {split} split has no such column "
                                f"(columns: {', '.join(ds.column_names)})", "pass --text_column with one of those"))
    if len(ds) == 0:
        raise DataError(Problem("--dataset", split, "this split is empty", "point --dataset at data with documents"))
    eos = tokenizer.eos_token_id

    def encode(batch):
        texts = [t if isinstance(t, str) else "" for t in batch[text_column]]
        ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
        return {"input_ids": [x + [eos] if x else [] for x in ids]}  # one row per document, even an empty one

    # process pools only pay off on large datasets
    nproc = max(1, min(tokenizing_processes(num_proc), len(ds) // 1000 or 1))
    return ds.map(encode, batched=True, batch_size=1000, num_proc=nproc if nproc > 1 else None,
                  remove_columns=ds.column_names, desc=f"tokenizing {split}")


def tokenizing_processes(num_proc: int | None) -> int:
    """--num_proc, else the CPUs available to this process, at most 16."""
    return num_proc or min(16, len(os.sched_getaffinity(0)))


def write_token_file(tokenized, path: Path, dtype, vocab_size: int | None = None) -> int:
    """Write every document's ids back to back; write to a temporary name and rename, so readers never see half."""
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        total = append_tokens(tokenized, f, dtype, vocab_size)
    os.replace(tmp, path)
    return total


def append_tokens(tokenized, f, dtype, vocab_size: int | None = None) -> int:
    """Append every document's ids to the open file `f`; returns the count. `vocab_size`: ids given as data
    (`input_ids`) are checked against it before they are narrowed to `dtype`."""
    total = 0
    for batch in tokenized.iter(batch_size=4096):
        docs = [x for x in batch["input_ids"] if len(x)]
        if docs:
            arr = np.concatenate([np.asarray(x, dtype=np.int64 if vocab_size else dtype) for x in docs])
            if vocab_size:
                check_token_ids(arr, vocab_size, "--dataset", "the `input_ids` column")
                arr = arr.astype(dtype)
            arr.tofile(f)
            total += arr.size
    return total


def check_token_ids(tokens: np.ndarray, vocab_size: int, setting: str, where: str) -> None:
    """Token ids given as data must be ids of the run's tokenizer: a larger one would fail in the embedding (or wrap
    in a narrower dtype). Read in pieces, so a memory-mapped array is never copied whole."""
    piece = 1 << 24
    for start in range(0, len(tokens), piece):
        part = np.asarray(tokens[start:start + piece])
        if part.size and (int(part.max()) >= vocab_size or int(part.min()) < 0):
            bad = int(part.max()) if int(part.max()) >= vocab_size else int(part.min())
            raise DataError(Problem(setting, where, f"holds token id {bad}, outside the tokenizer's {vocab_size} ids",
                                    "use the tokenizer those ids were made with (--tokenizer), or tokenize the text "
                                    "with this one"))


def token_fingerprint(tokens: np.ndarray) -> str:
    """A digest of a token array that is cheap on any size: its length, dtype and 64 evenly spaced pieces of 4096 tokens
    (all of it when smaller), and a mixture's weights and selection (ShardedTokens.note). A resume compares it with the
    checkpoint's to refuse a data position counted in
    other data (different files, another tokenization, another --max_documents)."""
    digest = hashlib.sha256(f"{len(tokens)}|{tokens.dtype}|{getattr(tokens, 'note', '')}".encode())
    piece = 4096
    if len(tokens) <= 64 * piece:
        digest.update(np.ascontiguousarray(tokens).tobytes())
    else:
        for start in np.linspace(0, len(tokens) - piece, 64).astype(np.int64):
            digest.update(np.ascontiguousarray(tokens[start:start + piece]).tobytes())
    return digest.hexdigest()[:16]


def cache_dir_for(cfg: TrainConfig, source: DataSource, tokenizer) -> Path:
    parts = [source.identity(), tokenizer_identity(tokenizer), cfg.text_column, str(cfg.dataset_config_name)]
    if cfg.max_documents:  # all documents keep the key they always had
        parts.append(f"max_documents={cfg.max_documents}")
    key = hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]
    root = Path(cfg.data_cache_dir) if cfg.data_cache_dir else default_cache_root()
    return root / "packed" / key


def build_token_files(cfg: TrainConfig, tokenizer, out_dir: Path, log=print,
                      source: DataSource | None = None, progress=None) -> None:
    """Load, tokenize and write train.bin (and validation.bin when the data has that split). One process only.
    `progress`: a data.progress.Progress that counts the documents and tokens as they are written."""
    source = source or resolve_source(cfg)
    before = _identity_now(source)
    train_ds, val_ds = load_splits(source, cfg)
    dtype = token_dtype(len(tokenizer))
    out_dir.mkdir(parents=True, exist_ok=True)
    if progress is not None:
        progress.set_total(sum(len(ds) for ds in (train_ds, val_ds) if ds is not None))
    counts = {}
    for split, ds in (("train", train_ds), ("validation", val_ds)):
        if ds is None:
            continue
        path = out_dir / f"{split}.bin"
        tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
        vocab_size = len(tokenizer) if is_pretokenized(ds, cfg.text_column) else None
        counts[split] = 0
        with open(tmp, "wb") as f:
            for start in range(0, max(len(ds), 1), _tokenize_chunk(len(ds))):
                part = ds.select(range(start, min(len(ds), start + _tokenize_chunk(len(ds))))) if len(ds) else ds
                written = append_tokens(tokenize_split(part, tokenizer, cfg.text_column, cfg.num_proc, split), f,
                                        dtype, vocab_size)
                counts[split] += written
                if progress is not None:
                    progress.update(len(part), written, len(part))
        os.replace(tmp, path)
        if counts[split] == 0:
            raise DataError(Problem("--dataset", cfg.dataset or "embedded corpus",
                                    f"the {split} split is empty after tokenization",
                                    f"check that column '{cfg.text_column}' holds text"))
    if _identity_now(source) != before:  # the cache is keyed by the data as it was: refuse to key the new one so
        shutil.rmtree(out_dir, ignore_errors=True)
        raise DataError(Problem("--dataset", source.location, "changed while it was being read and tokenized",
                                "let whatever writes it finish, then run again (the partial cache was removed)"))
    meta = {"source": before, "dtype": np.dtype(dtype).name, "tokens": counts,
            "documents": {"train": len(train_ds), "validation": len(val_ds) if val_ds is not None else 0}}
    # Written last: its presence marks a complete cache entry.
    (out_dir / "meta.json").write_text(json.dumps(meta, indent=1))
    log(f"data: wrote {counts} tokens to {out_dir}")


# Documents per tokenization call of the trainer's own cache: progress (documents, tokens, ETA) is reported between
# calls, and each call starts datasets' process pool anew, so a corpus is cut into at most about 20 of them.
TOKENIZE_CHUNK_DOCUMENTS = 200_000


def _tokenize_chunk(documents: int) -> int:
    return max(TOKENIZE_CHUNK_DOCUMENTS, -(-documents // 20))


def _identity_now(source: DataSource) -> str:
    try:
        return source.identity()
    except OSError as e:  # a file listed a moment ago is gone
        raise DataError(Problem("--dataset", getattr(e, "filename", None) or source.location,
                                f"disappeared while the data was being prepared ({e.strerror or e})",
                                "restore it (or remove it from the dataset directory), then run again")) from e


@dataclass
class CacheFiles:
    """The files beside a token cache entry through which its preparer and the waiting ranks meet (beside it, not in
    it: a refused preparation removes the entry)."""

    entry: Path

    @property
    def finished(self) -> Path:
        return self.entry / "meta.json"

    def beside(self, what: str) -> Path:
        return self.entry.with_name(f"{self.entry.name}.{what}.json")


def ensure_token_cache(cfg: TrainConfig, source: DataSource, tokenizer, out_dir: Path, dist, log=print,
                       build=None) -> None:
    """Build the token cache entry `out_dir` once: global rank 0 builds it, and where a node cannot see rank 0's
    claim on it (a node-local cache directory) that node's first rank builds its own. Every other rank polls the
    entry's finished marker, printing the preparer's progress (documents, tokens, rate, ETA), and raises the
    preparer's problem when it records one, or a problem naming the progress file when the preparer stops advancing
    it for --data_stale_minutes. The one collective here (rank 0's claim) comes before any tokenization, so no
    collective timeout bounds the preparation. `build`: what fills the entry, build_token_files's arguments (None:
    build_token_files; fine-tuning data: sft_data's packing)."""
    import socket
    import uuid

    files = CacheFiles(out_dir)
    claim = None
    if dist.rank == 0:
        claim = "ready" if files.finished.exists() else f"rank0-{uuid.uuid4().hex}"
        if claim != "ready":
            out_dir.parent.mkdir(parents=True, exist_ok=True)
            write_json_atomic(files.beside("claim"), {"claim": claim})
    claim = dist.broadcast_object(claim)
    if files.finished.exists():
        return
    seen = read_json(files.beside("claim")) or {}
    if claim != "ready" and seen.get("claim") == claim:
        mine, builds = claim, dist.rank == 0  # a cache directory shared with rank 0
    else:  # this node's own cache directory
        mine, builds = f"{claim}@{socket.gethostname()}", dist.local_rank == 0
        if builds:
            out_dir.parent.mkdir(parents=True, exist_ok=True)
            write_json_atomic(files.beside("claim"), {"claim": mine})
    if builds:
        try:
            with Progress(files.beside("progress"), "data: tokenizing", claim=mine) as progress:
                (build or build_token_files)(cfg, tokenizer, out_dir, log, source, progress=progress)
        except DataError as e:
            record_failure(files.beside("failed"), e.problem, mine)
            raise
        return
    speaks = dist.local_rank == 0 or dist.rank == 1  # one waiting rank per node prints the progress
    try:
        wait_for_preparer(files.finished, files.beside("progress"), files.beside("failed"), mine,
                          f"the token cache {out_dir}", cfg.data_stale_minutes * 60,
                          log=lambda line: print(f"[rank {dist.rank}] {line}", flush=True), quiet=not speaks)
    except PreparationFailed as e:
        raise (PreparerLost if e.lost else DataError)(e.problem) from e
