"""Data: load, tokenize, concatenate and pack into fixed blocks; shard across ranks in a deterministic order.

Pipeline (done once, cached, by one process; the others wait and memory-map the result):
  1. load   a save_to_disk directory, local text/JSONL/Parquet files, a hub dataset, or the embedded corpus;
  2. tokenize with `datasets.map` (batched, cached, num_proc), an EOS after every document;
  3. write  all token ids of a split back to back into one flat binary file (uint16/uint32);
  4. pack   block i = tokens[i*T : i*T + T + 1]: inputs are its first T tokens, targets its last T. Consecutive
            blocks overlap by one token, so every token after the first is a target exactly once: no padding, and
            nothing but the final partial block is dropped.

Order: epoch e visits the training blocks in `permutation(seed, e)`. Global micro-batch k covers positions
[k*W*m, (k+1)*W*m) of that permutation (W ranks, m blocks each); rank r takes its r-th slice of m. The position
(epoch, blocks consumed) is therefore independent of the world size, a resumed run continues at the same place, and
nothing already consumed is read again.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .config import Problem, TrainConfig
from .corpus import build_embedded_corpus, default_cache_root

VALIDATION_SPLIT_NAMES = ("validation", "valid", "val", "dev")
FILE_BUILDERS = {".txt": "text", ".text": "text", ".md": "text", ".json": "json", ".jsonl": "json",
                 ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}
HELD_OUT_SEED = 0  # the held-out validation blocks must not move when the training seed changes


class DataError(Exception):
    def __init__(self, problem: Problem):
        self.problem = problem
        super().__init__(str(problem))

    def __reduce__(self):  # raised in a worker process, re-raised in the parent with its Problem
        return (type(self), (self.problem,))


class PreparerLost(DataError):
    """A waiting rank's preparer died, hangs or never reported: unlike a DataError that every rank raises together,
    the preparer is not there to meet the others in a collective."""


# --------------------------------------------------------------------------------------------------------------------
# Where the data comes from
# --------------------------------------------------------------------------------------------------------------------
@dataclass
class DataSource:
    # "disk" (save_to_disk), "files", "hub", "embedded", "prepared" (model_utils.prepare's manifest), "npy" (token
    # files), "mixture" (parts with weights), "stream" (--streaming: hub or files read as a stream, streaming.py)
    kind: str
    location: str
    files: list[str] | None = None
    builder: str | None = None
    parts: list[tuple["DataSource", float]] | None = None

    def identity(self) -> str:
        """A string that changes when the data changes, computed without loading it."""
        if self.kind == "mixture":
            return json.dumps([self.kind, [(part.identity(), weight) for part, weight in self.parts]])
        if self.kind == "prepared":
            manifest = Path(self.location) / "manifest.json"
            return json.dumps([self.kind, os.path.abspath(self.location), manifest.stat().st_size,
                               int(manifest.stat().st_mtime)])
        if self.kind in ("files", "embedded", "npy"):
            stats = [(f, os.path.getsize(f), int(os.path.getmtime(f))) for f in self.files]
            return json.dumps([self.kind, stats])
        if self.kind == "disk":
            stats = sorted((str(p.relative_to(self.location)), p.stat().st_size, int(p.stat().st_mtime))
                           for p in Path(self.location).rglob("*.json"))
            return json.dumps([self.kind, os.path.abspath(self.location), stats])
        return json.dumps([self.kind, self.location])


def _with_dataset(cfg, dataset: str):
    """The data settings of one part of a mixture."""
    return dataclasses.replace(cfg, dataset=dataset)


def _is_saved_dataset(path: Path) -> bool:
    return (path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists() or (path / "state.json").exists()


def resolve_source(cfg: TrainConfig) -> DataSource:
    """Decide what DATASET means, or raise DataError naming the setting and the fix."""
    if cfg.streaming:
        from .streaming import resolve_stream

        return resolve_stream(cfg, resolve_source(dataclasses.replace(cfg, streaming=False)))
    if not cfg.dataset or cfg.dataset == "embedded":
        corpus = build_embedded_corpus(Path(cfg.data_cache_dir) if cfg.data_cache_dir else None)
        return DataSource("embedded", str(corpus), files=[str(corpus)], builder="json")
    if cfg.dataset == "embedded-chat" and not Path(cfg.dataset).exists():
        from .sft_corpus import SPLITS, build_sft_corpus

        corpus = build_sft_corpus(Path(cfg.data_cache_dir) if cfg.data_cache_dir else None)
        return DataSource("embedded-chat", str(corpus), files=[str(corpus / f"{split}.jsonl") for split in SPLITS],
                          builder="json")
    from .mixture import parse_mixture

    mixture = parse_mixture(cfg.dataset)
    if mixture is not None:
        return DataSource("mixture", cfg.dataset, parts=[(resolve_source(_with_dataset(cfg, path)), weight)
                                                         for path, weight in mixture])
    path = Path(cfg.dataset)
    if path.is_dir() and (path / "manifest.json").exists():
        from .prepare import is_prepared

        if not is_prepared(path):
            raise DataError(Problem("--dataset", cfg.dataset, "holds a manifest.json that is not a finished "
                                    "preparation of model_utils.prepare", "run the preparation to its end, or point "
                                    "--dataset at the raw data"))
        return DataSource("prepared", str(path))
    if path.suffix == ".npy" and path.is_file():
        return DataSource("npy", str(path), files=[str(path)])
    if path.is_dir() and not _is_saved_dataset(path):
        arrays = sorted(glob.glob(str(path / "**" / "*.npy"), recursive=True))
        if arrays and not any(Path(f).suffix.lower() in FILE_BUILDERS for f in glob.glob(str(path / "**" / "*"),
                                                                                           recursive=True)):
            return DataSource("npy", str(path), files=arrays)
    if cfg.local_dataset == "false" or (cfg.local_dataset == "auto" and not path.exists()):
        if cfg.local_dataset == "auto" and (cfg.dataset.startswith(("/", "./", "../", "~")) or cfg.dataset.count("/") > 1):
            raise DataError(Problem("--dataset", cfg.dataset, "this path does not exist",
                                    "fix the path (relative paths start from the working directory)"))
        return DataSource("hub", cfg.dataset)
    if not path.exists():
        raise DataError(Problem("--dataset", cfg.dataset, "this path does not exist (LOCAL_DATASET=true)",
                                "fix the path, or set LOCAL_DATASET=false for a hub dataset"))
    if path.is_dir() and _is_saved_dataset(path):
        return DataSource("disk", str(path))
    files = [str(path)] if path.is_file() else sorted(
        f for f in glob.glob(str(path / "**" / "*"), recursive=True)
        if os.path.isfile(f) and Path(f).suffix.lower() in FILE_BUILDERS)
    if not files:
        raise DataError(Problem("--dataset", cfg.dataset, "holds no dataset files",
                                f"use a save_to_disk directory or files ending in {', '.join(sorted(FILE_BUILDERS))}"))
    # Empty files hold no documents, and datasets' JSON reader cannot infer a schema from one (StopIteration).
    files = [f for f in files if os.path.getsize(f) > 0]
    if not files:
        raise DataError(Problem("--dataset", cfg.dataset, "holds only empty files", "point --dataset at files with documents"))
    builders = {FILE_BUILDERS.get(Path(f).suffix.lower()) for f in files}
    if None in builders or len(builders) != 1:
        raise DataError(Problem("--dataset", cfg.dataset, f"mixes or contains unsupported file types ({sorted(map(str, builders))})",
                                "keep one format per dataset: .txt, .jsonl/.json, .parquet, .csv or .arrow"))
    return DataSource("files", str(path), files=files, builder=builders.pop())


# What datasets raises for a wrong name or config, a missing file or no network.
LOAD_ERRORS = (FileNotFoundError, ValueError, ConnectionError, OSError)


def load_problem(source: DataSource, error: Exception) -> DataError:
    """DATASET could not be loaded: from the hub (its name, its config, the network) or from its files (the file and
    line at fault, found by `locate_bad_file`)."""
    if source.files:
        found = locate_bad_file(source.files)
        if found:
            return DataError(Problem("--dataset", found[0], found[1], "fix or remove that part of the file (or the "
                                     "file), then run again; nothing was trained"))
    cause = error.__cause__ or error.__context__ or error
    reason = (str(cause).strip().splitlines() or [type(cause).__name__])[0]
    if source.kind == "hub":
        return DataError(Problem("--dataset", source.location, f"could not be loaded from the hub: {reason}",
                                 "check the name and DATASET_CONFIG_NAME, network access and HF_TOKEN, "
                                 "or pass a local path"))
    return DataError(Problem("--dataset", source.location, f"could not be read: {reason}", "check the files"))


# What datasets (through pyarrow, pandas or Python's decoder) raises for a file it cannot parse.
def _parse_errors() -> tuple:
    import pyarrow
    from datasets.exceptions import DatasetGenerationError

    return (DatasetGenerationError, pyarrow.ArrowException, UnicodeDecodeError, ValueError, OSError)


def locate_bad_file(files: list[str]) -> tuple[str, str] | None:
    """(file, what is wrong where) for the first of `files` that does not parse, checked line by line where the format
    has lines; None when each parses (the failure was elsewhere). Run only after a load failed."""
    for path in files:
        try:
            reason = _file_problem(path)
        except OSError as e:  # vanished or unreadable
            reason = f"cannot be read ({e.strerror or e})"
        if reason:
            return path, reason
    return None


def _file_problem(path: str) -> str | None:
    import json as json_module

    suffix = Path(path).suffix.lower()
    builder = FILE_BUILDERS.get(suffix)
    if builder == "parquet":
        import pyarrow
        import pyarrow.parquet

        try:
            pyarrow.parquet.ParquetFile(path)
        except pyarrow.ArrowException as e:
            return f"is not a readable Parquet file ({str(e).splitlines()[0]})"
        return None
    if builder == "arrow":
        return None
    raw = Path(path).read_bytes()
    for number, line in enumerate(raw.split(b"\n"), start=1):
        try:
            line.decode("utf-8")
        except UnicodeDecodeError as e:
            return f"line {number} is not UTF-8 text (byte {e.start + 1} of the line: {line[e.start:e.start + 1]!r})"
    text = raw.decode("utf-8")
    if builder == "json":
        if text.lstrip().startswith("["):  # one JSON document (a list of records)
            try:
                json_module.loads(text)
            except json_module.JSONDecodeError as e:
                return f"is not valid JSON at line {e.lineno}, column {e.colno} ({e.msg})"
            return None
        for number, line in enumerate(text.splitlines(), start=1):  # JSON Lines: one record per line
            if line.strip():
                try:
                    record = json_module.loads(line)
                except json_module.JSONDecodeError as e:
                    return f"line {number} is not valid JSON ({e.msg}, column {e.colno})"
                if not isinstance(record, dict):
                    return f"line {number} is not a JSON object ({type(record).__name__}): each line must be one record"
        return None
    if builder == "csv":
        import csv

        rows = csv.reader(text.splitlines())
        header = next(rows, [])
        for number, row in enumerate(rows, start=2):
            if row and len(row) != len(header):
                return f"line {number} has {len(row)} fields, the header has {len(header)}"
    return None


def load_splits(source: DataSource, cfg: TrainConfig):
    """Return (train, validation or None) as `datasets.Dataset` objects."""
    import datasets

    if cfg.max_documents and source.kind != "disk":
        return _first_documents(source, cfg)
    if source.kind == "disk":
        try:
            loaded = datasets.load_from_disk(source.location)
        except IndexError as e:  # datasets cannot even open a saved dataset with zero rows
            raise DataError(Problem("--dataset", source.location, "this saved dataset is empty",
                                    "point --dataset at data with documents")) from e
    elif source.kind in ("files", "embedded"):
        try:
            loaded = datasets.load_dataset(source.builder, data_files={"train": source.files},
                                           cache_dir=_hf_cache(cfg))
        except _parse_errors() as e:
            raise load_problem(source, e) from e
    else:
        try:
            loaded = datasets.load_dataset(source.location, cfg.dataset_config_name, cache_dir=_hf_cache(cfg))
        except LOAD_ERRORS as e:
            raise load_problem(source, e) from e
    if isinstance(loaded, datasets.Dataset):
        loaded = datasets.DatasetDict({"train": loaded})
    train_name, val_name = _split_names(list(loaded))
    splits = loaded[train_name], (loaded[val_name] if val_name else None)
    if cfg.max_documents:
        splits = tuple(s.select(range(min(cfg.max_documents, len(s)))) if s is not None else None for s in splits)
    return splits


def _split_names(names: list[str]) -> tuple[str, str | None]:
    """The training split ('train', else the first) and the validation split, if the data has one."""
    return ("train" if "train" in names else names[0]), next((n for n in VALIDATION_SPLIT_NAMES if n in names), None)


def _first_documents(source: DataSource, cfg: TrainConfig):
    """--max_documents N: the first N documents of each split, streamed (of a hub dataset only the shards that hold them
    are downloaded) and written as an Arrow dataset to tokenize as usual."""
    import datasets
    from datasets.arrow_writer import SchemaInferenceError
    from datasets.exceptions import DatasetGenerationError

    location = source.location if source.kind == "hub" else source.builder
    name = cfg.dataset_config_name if source.kind == "hub" else None
    data_files = None if source.kind == "hub" else {"train": source.files}
    try:
        names = list(datasets.load_dataset(location, name, data_files=data_files, streaming=True))
    except LOAD_ERRORS as e:
        raise load_problem(source, e) from e
    splits = []
    for split in _split_names(names):
        if split is None:
            splits.append(None)
            continue
        try:
            # The source's identity is part of the generator's arguments, so datasets' own cache of this Arrow
            # dataset changes with the files.
            splits.append(datasets.Dataset.from_generator(
                stream_documents, cache_dir=_hf_cache(cfg),
                gen_kwargs={"location": location, "name": name, "data_files": data_files, "split": split,
                            "limit": cfg.max_documents, "identity": source.identity()}))
        except DatasetGenerationError as e:
            if isinstance(e.__cause__, SchemaInferenceError):  # not one document
                raise DataError(Problem("--dataset", source.location, f"the {split} split is empty",
                                        "point --dataset at data with documents")) from e
            raise load_problem(source, e) from e
    return tuple(splits)


def stream_documents(location, name, data_files, split, limit, identity=None):
    """The first `limit` documents of a split, streamed. `identity` only keys datasets' cache of the result."""
    import datasets

    yield from datasets.load_dataset(location, name, data_files=data_files, split=split, streaming=True).take(limit)


def _hf_cache(cfg: TrainConfig) -> str | None:
    return os.path.join(cfg.data_cache_dir, "hf") if cfg.data_cache_dir else None


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


# --------------------------------------------------------------------------------------------------------------------
# Packed blocks and the order they are visited in
# --------------------------------------------------------------------------------------------------------------------
def block_count(num_tokens: int, seq_len: int) -> int:
    """Blocks of seq_len + 1 tokens overlapping by one that num_tokens hold."""
    return max(0, (num_tokens - 1) // seq_len)


def token_fingerprint(tokens: np.ndarray) -> str:
    """A digest of a token array that is cheap on any size: its length, dtype and 64 evenly spaced pieces of 4096
    tokens (all of it when smaller), and a mixture's weights and selection (ShardedTokens.note). A resume compares it with the checkpoint's to refuse a data position counted in
    other data (different files, another tokenization, another --max_documents)."""
    digest = hashlib.sha256(f"{len(tokens)}|{tokens.dtype}|{getattr(tokens, 'note', '')}".encode())
    piece = 4096
    if len(tokens) <= 64 * piece:
        digest.update(np.ascontiguousarray(tokens).tobytes())
    else:
        for start in np.linspace(0, len(tokens) - piece, 64).astype(np.int64):
            digest.update(np.ascontiguousarray(tokens[start:start + piece]).tobytes())
    return digest.hexdigest()[:16]


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


def _held_out_split(num_blocks: int, fraction: float) -> tuple[np.ndarray, np.ndarray]:
    ids = np.random.default_rng(HELD_OUT_SEED).permutation(num_blocks)
    n_val = held_out_count(num_blocks, fraction)
    return np.sort(ids[n_val:]), np.sort(ids[:n_val])


def _memmap(path: Path, dtype) -> np.ndarray:
    if path.stat().st_size == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r")


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
    `progress`: a data_progress.Progress that counts the documents and tokens as they are written."""
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


def open_packed(cfg: TrainConfig, out_dir: Path, seq_len: int) -> PackedData:
    meta = json.loads((out_dir / "meta.json").read_text())
    dtype = np.dtype(meta["dtype"])
    validation = _memmap(out_dir / "validation.bin", dtype) if (out_dir / "validation.bin").exists() else None
    return packed_blocks(_memmap(out_dir / "train.bin", dtype), validation, cfg.validation_fraction, seq_len,
                         f"{meta['documents']['train']} documents, {meta['tokens']['train']:,} tokens")


def packed_blocks(train_tokens, validation_tokens, validation_fraction: float, seq_len: int, what: str) -> PackedData:
    """Blocks of the training tokens, and validation blocks: the validation split's, else held out of training."""
    train = PackedTokens(train_tokens, seq_len)
    if validation_tokens is not None:
        val = PackedTokens(validation_tokens, seq_len)
        train_ids, val_ids = np.arange(train.num_blocks), np.arange(val.num_blocks)
    else:
        val = train
        train_ids, val_ids = _held_out_split(train.num_blocks, validation_fraction)
    desc = f"{what} -> {len(train_ids):,} training blocks of {seq_len} (+{len(val_ids):,} validation)"
    return PackedData(train, train_ids, val, val_ids, desc)


def open_prepared(cfg: TrainConfig, source: DataSource, tokenizer, seq_len: int) -> PackedData:
    """Memory-map the shards of a model_utils.prepare directory (nothing is copied: the time does not grow with the
    corpus). The shards of a split form one token stream in the manifest's order, and blocks span shard boundaries,
    so the blocks are those of the same documents tokenized by the trainer itself. The tokenizer that prepared them
    must be this run's."""
    from .prepare import MANIFEST

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
        splits.setdefault(entry["split"], []).append(_memmap(path, dtype)[:entry["tokens"]])
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
    train_ids, val_ids = _held_out_split(packed.num_blocks, DUMMY_VALIDATION_FRACTION)
    return PackedData(packed, train_ids, packed, val_ids, f"dummy data: {num_blocks} random blocks of {seq_len}")


def prepare_data(cfg: TrainConfig, tokenizer, seq_len: int, dist, log=print, source: DataSource | None = None,
                 seed: int = 0, data_format: str | None = None) -> PackedData:
    """The run's packed data on every rank. Prepared directories and token files are memory-mapped by each rank; raw
    data are tokenized once into the token cache (ensure_token_cache) while the other ranks wait on its files; a
    mixture does either for each part; a stream (--streaming) is read by each rank as it trains (streaming.py).
    `source`: what --dataset means, as the run's plan resolved it (resolved here where not given); `seed`: the run's
    --seed (random blocks, a mixture's draw); `data_format`: a fine-tuning format (sft_data.resolve_data_format) packs
    examples with their labels (sft_data.open_sft_source) instead."""
    if cfg.dummy_data:
        return dummy_packed(cfg.dummy_data, seq_len, len(tokenizer), seed)
    source = source or resolve_source(cfg)
    if source.kind == "stream":
        from .streaming import open_stream

        return open_stream(cfg, source, tokenizer, seq_len, dist, log, seed)
    from .sft_data import FORMATS, open_sft_source

    if data_format in FORMATS:
        return open_sft_source(cfg, source, tokenizer, seq_len, data_format, dist, log)
    if source.kind == "mixture":
        from .mixture import mix

        parts = [(part, weight, open_source(_with_dataset(cfg, part.location), part, tokenizer, seq_len, dist, log))
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


def describe_without_tokenizing(cfg: TrainConfig, source: DataSource, tokenizer, seq_len: int) -> tuple[str, int | None]:
    """For the preflight: the data line and the training blocks of a prepared directory, token files or a mixture,
    opened as the run opens them (memory maps: nothing is read whole); a mixture's raw parts count where their token
    cache is built, else the blocks are unknown (None). Raises DataError as the run would."""
    if source.kind != "mixture":
        data = open_source(cfg, source, tokenizer, seq_len, dist=None)
        return f"data: {data.description}", len(data.train_ids)
    blocks, parts = 0, []
    for part, weight in source.parts:
        view = _with_dataset(cfg, part.location)
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

    from .data_progress import PreparationFailed, Progress, read_json, record_failure, wait_for_preparer, \
        write_json_atomic

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
