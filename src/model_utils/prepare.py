"""Prepare a corpus once, before training: tokenize it with every core (and every node) into token shards that
training memory-maps.

    python -m model_utils.prepare --dataset SRC --tokenizer TOK --output DIR [--num_proc N] [--text_column text]
                                  [--max_documents N] [--shard_mb MB]

SRC is anything --dataset takes (local files, a save_to_disk directory, a hub dataset). The input is cut into shards
(a byte range of a JSONL or text file, row groups of a Parquet file, a row range of an Arrow dataset); a process pool
tokenizes them with the fast tokenizer's batch encode, an EOS after every document, as the trainer's own tokenization
does. Each shard becomes DIR/shards/<split>-NNNNN.bin (the token ids back to back, uint16 when the vocabulary fits,
else uint32) and .idx.npy (int64 offsets of its documents, one more than documents), then a .done marker. A rerun of
the same command skips every shard with a marker. Under SLURM (SLURM_PROCID and SLURM_NTASKS set) task i takes
shards i, i + n, i + 2n, ... and the task that finds every shard done writes DIR/manifest.json (renamed into place):
the source, the tokenizer's identity, the dtype, the shards in order and the counts. `--dataset DIR` trains on it.
See docs/DATA-PREPARATION.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import os
import socket
import sys
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .config import Problem
from .data_progress import PreparationFailed, Progress, read_json, record_failure, write_json_atomic
from .exit_status import BAD_INPUT

FORMAT = "deepspeed-lm-prepared-tokens"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
PLAN = "plan.json"
FAILURE = "FAILED.json"
SHARDS_DIR = "shards"
PROGRESS_DIR = "progress"
ENCODE_BATCH = 1000  # documents per batch encode
MIN_SHARD_BYTES, MAX_SHARD_BYTES, TARGET_SHARDS = 1 << 20, 256 << 20, 256


def is_prepared(path: str | os.PathLike) -> bool:
    """A directory that holds this format's manifest."""
    manifest = read_json(Path(path) / MANIFEST) if Path(path).is_dir() else None
    return manifest is not None and manifest.get("format") == FORMAT


# --------------------------------------------------------------------------------------------------------------------
# Shards: which piece of the input each one reads
# --------------------------------------------------------------------------------------------------------------------
@dataclass
class Shard:
    split: str
    index: int
    kind: str  # "lines" (JSONL or text byte range), "records" (a JSON array file), "parquet" (row groups), "rows"
    path: str  # the file; for "rows" a JSON list of Arrow files
    start: int  # byte offset, first row group or first row
    stop: int  # end byte offset, end row group or end row (exclusive)
    weight: float  # input bytes it covers: its share of the progress
    text_format: str = "json"  # "lines" shards: json (JSONL) or text (one document per line)

    @property
    def name(self) -> str:
        return f"{self.split}-{self.index:05d}"

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def shard_bytes_for(total_bytes: int, shard_mb: float | None) -> int:
    """The input bytes per shard: --shard_mb, else about TARGET_SHARDS shards, within [1 MiB, 256 MiB]. It depends
    on the input only, so every SLURM task and every rerun plans the same shards."""
    if shard_mb:
        return max(1, int(shard_mb * (1 << 20)))
    return int(min(MAX_SHARD_BYTES, max(MIN_SHARD_BYTES, total_bytes // TARGET_SHARDS)))


def plan_shards(source, cfg, shard_mb: float | None) -> list[Shard]:
    """Every shard of the input, in the order the trainer reads its documents (files sorted, then their contents)."""
    from .concat_dataset import DataError

    if source.kind in ("files", "embedded") and source.builder in ("json", "text", "parquet"):
        pieces = []
        for path in source.files:
            if source.builder == "parquet":
                pieces.append(("parquet", path, os.path.getsize(path)))
            elif source.builder == "json" and _starts_with_bracket(path):
                pieces.append(("records", path, os.path.getsize(path)))
            else:
                pieces.append(("lines", path, os.path.getsize(path)))
        size = shard_bytes_for(sum(p[2] for p in pieces), shard_mb)
        shards = []
        for kind, path, nbytes in pieces:
            for start, stop, weight in _ranges(kind, path, nbytes, size):
                shards.append(Shard("train", len(shards), kind, path, start, stop, weight, source.builder))
        return shards
    if source.kind == "prepared":
        raise DataError(Problem("--dataset", source.location, "is already a prepared token directory",
                                "train on it with --dataset " + source.location))
    return _row_shards(source, cfg, shard_mb)


def _starts_with_bracket(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(4096).lstrip()[:1] == b"["


def _ranges(kind: str, path: str, nbytes: int, size: int):
    if kind == "records":
        yield 0, nbytes, float(nbytes)
    elif kind == "lines":
        for start in range(0, nbytes, size):
            yield start, min(nbytes, start + size), float(min(nbytes, start + size) - start)
    else:  # parquet: consecutive row groups up to `size` bytes each
        import pyarrow.parquet

        meta = pyarrow.parquet.ParquetFile(path).metadata
        first, acc = 0, 0
        for g in range(meta.num_row_groups):
            acc += meta.row_group(g).total_byte_size
            if acc >= size or g == meta.num_row_groups - 1:
                yield first, g + 1, float(acc)
                first, acc = g + 1, 0


def _row_shards(source, cfg, shard_mb) -> list[Shard]:
    """Row ranges of the Arrow files holding each split (a saved dataset, a hub download, CSV or Arrow files)."""
    from .concat_dataset import load_splits

    # --max_documents: a saved dataset or local files are cut by row range below; only a hub dataset is streamed.
    everything = dataclasses.replace(cfg, max_documents=cfg.max_documents if source.kind == "hub" else 0)
    shards = []
    for split, ds in zip(("train", "validation"), load_splits(source, everything)):
        if ds is None:
            continue
        files = _arrow_files(ds)
        rows = min(len(ds), cfg.max_documents) if cfg.max_documents else len(ds)
        row_bytes = max(1.0, ds.data.nbytes / max(1, len(ds)))
        per_shard = max(1, int(shard_bytes_for(int(row_bytes * rows), shard_mb) // row_bytes))
        for start in range(0, rows, per_shard):
            stop = min(rows, start + per_shard)
            shards.append(Shard(split, sum(s.split == split for s in shards), "rows", json.dumps(files), start, stop,
                                (stop - start) * row_bytes))
    return shards


def _arrow_files(ds) -> list[str]:
    """The Arrow files that hold exactly `ds`'s rows in order; a dataset that is a view or in memory is written to
    datasets' cache first."""
    files = [c["filename"] for c in ds.cache_files]
    if files and ds._indices is None:
        import datasets

        if sum(datasets.Dataset.from_file(f).num_rows for f in files) == len(ds):
            return files
    ds = ds.flatten_indices()
    return [c["filename"] for c in ds.cache_files]


# --------------------------------------------------------------------------------------------------------------------
# Reading a shard's documents
# --------------------------------------------------------------------------------------------------------------------
def shard_documents(shard: Shard, text_column: str):
    """Batches of (documents, input units read): a document is text (str) or token ids (list of int, from an
    `input_ids` field where the text column is absent)."""
    if shard.kind == "lines":
        yield from _line_documents(shard, text_column)
    elif shard.kind == "records":
        records = json.loads(Path(shard.path).read_text(encoding="utf-8"))
        docs = [_record_document(r, text_column, shard.path, i + 1) for i, r in enumerate(records)]
        _check_column(shard, text_column, docs)
        for i in range(0, len(docs), ENCODE_BATCH):
            yield docs[i:i + ENCODE_BATCH], shard.weight * min(ENCODE_BATCH, len(docs) - i) / max(1, len(docs))
    elif shard.kind == "parquet":
        yield from _parquet_documents(shard, text_column)
    else:
        yield from _row_documents(shard, text_column)


_MISSING = object()


def _record_document(record, text_column: str, path: str, line):
    """The record's text (or token ids); `line`: its number, or a function giving it (counted only for a problem)."""
    from .concat_dataset import DataError

    if not isinstance(record, dict):
        line = line() if callable(line) else line
        raise DataError(Problem("--dataset", path, f"record {line} is not a JSON object ({type(record).__name__})",
                                "make each line (or list item) one JSON object"))
    if text_column in record:
        text = record[text_column]
        return text if isinstance(text, str) else ""
    if isinstance(record.get("input_ids"), list):
        return record["input_ids"]
    return _MISSING


def _check_column(shard: Shard, text_column: str, docs: list) -> None:
    """A shard whose records all lack the text column (and `input_ids`) names the column."""
    from .concat_dataset import DataError

    if docs and all(d is _MISSING for d in docs):
        raise DataError(Problem("--text_column", text_column, f"{shard.path} has no such field in its records",
                                "pass --text_column with the field that holds the text (or give `input_ids`)"))
    for i, d in enumerate(docs):
        if d is _MISSING:
            docs[i] = ""


def _line_documents(shard: Shard, text_column: str):
    """The lines whose first byte lies in [start, stop): a line cut by the range's start belongs to the shard
    before. JSONL: one record per non-blank line; text: one document per line, split as Python's splitlines (the
    rule of datasets' text builder)."""
    from .concat_dataset import DataError

    with open(shard.path, "rb") as f:
        if shard.start > 0:
            f.seek(shard.start - 1)
            f.readline()  # the rest of the line that began in the shard before
        position = f.tell()
        docs, read_from = [], shard.start
        while position < shard.stop:
            line = f.readline()
            if not line:
                break
            try:
                text = line.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(Problem("--dataset", shard.path, f"line {_line_number(shard.path, position)} is not "
                                        f"UTF-8 text (byte {e.start + 1} of the line)",
                                        "fix or remove that line, then run again (finished shards are kept)")) from e
            if shard.text_format == "text":
                docs.extend(text.splitlines() or [""])
            elif text.strip():
                try:
                    record = json.loads(text)
                except json.JSONDecodeError as e:
                    raise DataError(Problem("--dataset", shard.path, f"line {_line_number(shard.path, position)} is "
                                            f"not valid JSON ({e.msg}, column {e.colno})",
                                            "fix or remove that line, then run again (finished shards are kept)")) from e
                docs.append(_record_document(record, text_column, shard.path,
                                             functools.partial(_line_number, shard.path, position)))
            position = f.tell()
            if len(docs) >= ENCODE_BATCH:
                if shard.text_format == "json":
                    _check_column(shard, text_column, docs)
                yield docs, float(min(position, shard.stop) - read_from)
                docs, read_from = [], position
        if shard.text_format == "json":
            _check_column(shard, text_column, docs)
        yield docs, float(max(0, shard.stop - read_from))


def _line_number(path: str, offset: int) -> int:
    """The 1-based line at byte `offset` (counted only to report a problem)."""
    with open(path, "rb") as f:
        return f.read(offset).count(b"\n") + 1


def _parquet_documents(shard: Shard, text_column: str):
    import pyarrow.parquet

    from .concat_dataset import DataError

    pf = pyarrow.parquet.ParquetFile(shard.path)
    names = pf.schema_arrow.names
    column = text_column if text_column in names else ("input_ids" if "input_ids" in names else None)
    if column is None:
        raise DataError(Problem("--text_column", text_column, f"{shard.path} has no such column (columns: "
                                f"{', '.join(names)})", "pass --text_column with one of those"))
    groups = list(range(shard.start, shard.stop))
    rows = sum(pf.metadata.row_group(g).num_rows for g in groups) or 1
    for batch in pf.iter_batches(batch_size=ENCODE_BATCH, row_groups=groups, columns=[column]):
        values = batch.column(0).to_pylist()
        if column == text_column:
            values = [v if isinstance(v, str) else "" for v in values]
        yield values, shard.weight * len(values) / rows


_ARROW_DATASETS: dict = {}  # per worker process: the concatenated Arrow files of a "rows" source


def _row_documents(shard: Shard, text_column: str):
    import datasets

    from .concat_dataset import DataError

    if shard.path not in _ARROW_DATASETS:
        _ARROW_DATASETS[shard.path] = datasets.concatenate_datasets(
            [datasets.Dataset.from_file(f) for f in json.loads(shard.path)])
    ds = _ARROW_DATASETS[shard.path]
    column = text_column if text_column in ds.column_names else (
        "input_ids" if "input_ids" in ds.column_names else None)
    if column is None:
        raise DataError(Problem("--text_column", text_column, f"the {shard.split} split has no such column "
                                f"(columns: {', '.join(ds.column_names)})", "pass --text_column with one of those"))
    part = ds.select(range(shard.start, shard.stop)).select_columns([column])
    rows = max(1, shard.stop - shard.start)
    for batch in part.iter(batch_size=ENCODE_BATCH):
        values = batch[column]
        if column == text_column:
            values = [v if isinstance(v, str) else "" for v in values]
        yield values, shard.weight * len(values) / rows


# --------------------------------------------------------------------------------------------------------------------
# Tokenizing a shard (in a worker process)
# --------------------------------------------------------------------------------------------------------------------
class Encoder:
    """Token ids of documents: the fast tokenizer's batch encode without special tokens, then an EOS after every
    non-empty document (ids given as `input_ids` get one unless they end with it already). Ids outside the
    vocabulary are a problem: they would wrap in the token file's dtype. `backend`: a `tokenizers.Tokenizer` (the
    fast tokenizer's own), else `tokenizer` (a transformers tokenizer) encodes."""

    def __init__(self, eos: int, vocab_size: int, backend=None, tokenizer=None):
        self.eos, self.vocab_size, self.backend, self.tokenizer = eos, vocab_size, backend, tokenizer

    @classmethod
    def spec(cls, tokenizer, name: str | None) -> tuple:
        """What a worker process needs to build the same encoder: the fast tokenizer serialized (no transformers
        import, no download in the worker), else the name to load."""
        backend = getattr(tokenizer, "backend_tokenizer", None)
        return (backend.to_str() if backend is not None else None, name, tokenizer.eos_token_id, len(tokenizer))

    @classmethod
    def from_spec(cls, spec: tuple) -> "Encoder":
        serialized, name, eos, vocab_size = spec
        if serialized is not None:
            from tokenizers import Tokenizer

            return cls(eos, vocab_size, backend=Tokenizer.from_str(serialized))
        from .tokenizer import load_tokenizer

        return cls(eos, vocab_size, tokenizer=load_tokenizer(name))

    def encode_texts(self, texts: list[str]) -> list[list[int]]:
        if self.backend is not None:
            return [e.ids for e in self.backend.encode_batch(texts, add_special_tokens=False)]
        return self.tokenizer(texts, add_special_tokens=False)["input_ids"]

    def __call__(self, docs: list, where: str) -> list[list[int]]:
        from .concat_dataset import check_token_ids, ends_with_eos

        texts = [i for i, d in enumerate(docs) if isinstance(d, str)]
        ids: list = list(docs)
        if texts:
            for i, encoded in zip(texts, self.encode_texts([docs[i] for i in texts])):
                ids[i] = encoded + [self.eos] if encoded else []
        for i, d in enumerate(docs):
            if not isinstance(d, str) and d:
                check_token_ids(np.asarray(d, dtype=np.int64), self.vocab_size, "--dataset", where)
                ids[i] = ends_with_eos(d, self.eos)
        return ids


_WORKER: dict = {}


def _start_worker(encoder_spec: tuple) -> None:
    # One core per worker process: the tokenizer's own thread pool would oversubscribe the pool's cores.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _WORKER["encoder"] = Encoder.from_spec(encoder_spec)


def tokenize_shard(shard: Shard, output: str, text_column: str, dtype_name: str, progress_queue=None) -> dict:
    """Write the shard's token file and document index (temporary names, then renamed), then its .done marker."""
    encoder = _WORKER.get("encoder")
    dtype = np.dtype(dtype_name)
    folder = Path(output) / SHARDS_DIR
    tmp_suffix = f".tmp-{socket.gethostname()}-{os.getpid()}"
    bin_path, idx_path = folder / f"{shard.name}.bin", folder / f"{shard.name}.idx.npy"
    bin_tmp, idx_tmp = Path(f"{bin_path}{tmp_suffix}"), Path(f"{idx_path}{tmp_suffix}.npy")
    lengths, tokens = [], 0
    with open(bin_tmp, "wb") as f:
        for docs, units in shard_documents(shard, text_column):
            ids = encoder(docs, shard.path if shard.kind != "rows" else f"the {shard.split} split") if docs else []
            sizes = [len(x) for x in ids]
            if sizes:
                flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=dtype, count=sum(sizes))
                flat.tofile(f)
            lengths.extend(sizes)
            tokens += sum(sizes)
            if progress_queue is not None:
                progress_queue.put((len(docs), sum(sizes), units))
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    np.save(idx_tmp, offsets)
    os.replace(bin_tmp, bin_path)
    os.replace(idx_tmp, idx_path)
    done = {"documents": len(lengths), "tokens": tokens, "weight": shard.weight, "host": socket.gethostname(),
            "pid": os.getpid()}
    write_json_atomic(folder / f"{shard.name}.done", done)
    return done


def finished_shard(output: Path, shard: Shard, dtype) -> dict | None:
    """The shard's .done record when its files are complete (the token file as long as recorded), else None."""
    folder = output / SHARDS_DIR
    done = read_json(folder / f"{shard.name}.done")
    if done is None:
        return None
    try:
        complete = (folder / f"{shard.name}.bin").stat().st_size == done["tokens"] * np.dtype(dtype).itemsize
    except FileNotFoundError:
        return None
    return done if complete and (folder / f"{shard.name}.idx.npy").exists() else None


# --------------------------------------------------------------------------------------------------------------------
# The preparation
# --------------------------------------------------------------------------------------------------------------------
@dataclass
class Task:
    """This process's place among the preparing tasks (SLURM_PROCID of SLURM_NTASKS; 0 of 1 without SLURM)."""

    index: int = 0
    count: int = 1

    @classmethod
    def from_environment(cls, environ=os.environ) -> "Task":
        if "SLURM_PROCID" in environ and "SLURM_NTASKS" in environ:
            return cls(int(environ["SLURM_PROCID"]), int(environ["SLURM_NTASKS"]))
        return cls()


def plan_identity(source, tokenizer, cfg, shards: list[Shard], tokenizer_name: str | None) -> dict:
    from .concat_dataset import token_dtype, tokenizer_identity

    return {"format": FORMAT, "version": FORMAT_VERSION, "dataset": str(cfg.dataset or "embedded corpus"),
            "source_kind": source.kind, "source_identity": source.identity(),
            "dataset_config_name": cfg.dataset_config_name, "text_column": cfg.text_column,
            "max_documents": cfg.max_documents,
            "tokenizer": {"name": tokenizer_name or "default", "identity": tokenizer_identity(tokenizer),
                          "vocab_size": len(tokenizer), "eos_token_id": tokenizer.eos_token_id},
            "dtype": np.dtype(token_dtype(len(tokenizer))).name, "shards": [s.as_dict() for s in shards]}


def prepare(cfg, tokenizer_name: str | None, output: Path, num_proc: int | None = None, shard_mb: float | None = None,
            task: Task | None = None, log=print, stream=None) -> dict | None:
    """Tokenize this task's unfinished shards of cfg.dataset into `output`; write the manifest when every shard is
    done. Returns the manifest (None while other tasks still work). Raises DataError on bad input, after recording
    it in output/FAILED.json."""
    from .concat_dataset import DataError, resolve_source
    from .tokenizer import load_tokenizer

    task = task or Task.from_environment()
    output.mkdir(parents=True, exist_ok=True)
    for folder in (SHARDS_DIR, PROGRESS_DIR):
        (output / folder).mkdir(exist_ok=True)
    if task.index == 0:
        (output / FAILURE).unlink(missing_ok=True)
    try:
        tokenizer = load_tokenizer(tokenizer_name)
        source = resolve_source(cfg)
        shards = plan_shards(source, cfg, shard_mb)
        if not shards:
            raise DataError(Problem("--dataset", cfg.dataset, "holds no documents", "point --dataset at data"))
        plan = plan_identity(source, tokenizer, cfg, shards, tokenizer_name)
        _agree_on_plan(output, plan)
        return _run_task(cfg, Encoder.spec(tokenizer, tokenizer_name), output, plan, shards, num_proc, task, log,
                         stream)
    except DataError as e:
        record_failure(output / FAILURE, e.problem)
        raise


def _agree_on_plan(output: Path, plan: dict) -> None:
    """The first attempt records the plan; a rerun (or another SLURM task) must find the same one."""
    from .concat_dataset import DataError

    recorded = read_json(output / PLAN)
    if recorded is None:
        write_json_atomic(output / PLAN, plan)
        return
    if recorded != plan:
        differ = sorted(k for k in set(plan) | set(recorded) if plan.get(k) != recorded.get(k))
        raise DataError(Problem("--output", str(output), "holds a preparation of other input or settings "
                                f"(differing: {', '.join(differ)})",
                                "pass another --output, or delete that directory to prepare it anew"))


def _run_task(cfg, encoder_spec: tuple, output: Path, plan: dict, shards: list[Shard], num_proc, task: Task, log,
              stream) -> dict | None:
    import multiprocessing

    dtype = plan["dtype"]
    mine = [s for i, s in enumerate(shards) if i % task.count == task.index]
    finished = {s.name: finished_shard(output, s, dtype) for s in mine}
    todo = [s for s in mine if finished[s.name] is None]
    who = f"prepare (task {task.index} of {task.count})" if task.count > 1 else "prepare"
    log(f"{who}: {len(shards)} shards of {plan['dataset']}; this task's {len(mine)}: {len(mine) - len(todo)} already "
        f"done, {len(todo)} to tokenize into {output}")
    workers = max(1, min(num_proc or len(os.sched_getaffinity(0)), len(todo) or 1))
    with Progress(output / PROGRESS_DIR / f"task-{task.index:05d}.json", who,
                  total_units=sum(s.weight for s in mine), stream=stream) as progress:
        done_before = [d for d in finished.values() if d is not None]
        progress.resume_from(sum(d["documents"] for d in done_before), sum(d["tokens"] for d in done_before),
                             sum(d["weight"] for d in done_before))
        if todo:
            context = multiprocessing.get_context("spawn")  # the tokenizer's threads do not survive a fork
            with context.Manager() as manager:
                pool = ProcessPoolExecutor(workers, mp_context=context, initializer=_start_worker,
                                           initargs=(encoder_spec,))
                try:
                    _tokenize_all(pool, todo, shards, output, cfg, dtype, manager.Queue(), progress, workers)
                finally:  # on a problem, shards not started are dropped; those running finish (and stay done)
                    pool.shutdown(wait=True, cancel_futures=True)
    return write_manifest_if_complete(output, plan, shards, cfg.max_documents, log)


def _tokenize_all(pool, todo, shards, output, cfg, dtype, queue, progress, workers) -> None:
    """Submit shards in order, a few per worker at a time; with --max_documents stop submitting once the shards
    done from the first one on hold that many documents."""
    pending, queued = set(), list(todo)
    while queued or pending:
        while queued and len(pending) < 2 * workers and not _enough_documents(output, shards, cfg.max_documents,
                                                                              dtype, queued[0].split):
            shard = queued.pop(0)
            pending.add(pool.submit(tokenize_shard, shard, str(output), cfg.text_column, dtype, queue))
        if not pending:
            break
        finished, pending = wait(pending, timeout=1.0, return_when=FIRST_COMPLETED)
        _drain(queue, progress)
        for future in finished:
            future.result()  # a worker's DataError stops the preparation here
        if cfg.max_documents:
            queued = [s for s in queued if not _enough_documents(output, shards, cfg.max_documents, dtype, s.split)]
    _drain(queue, progress)


def _drain(queue, progress) -> None:
    import queue as queue_module

    while True:
        try:
            progress.update(*queue.get_nowait())
        except queue_module.Empty:
            return


def _enough_documents(output, shards, max_documents, dtype, split) -> bool:
    if not max_documents:
        return False
    total = 0
    for shard in (s for s in shards if s.split == split):
        done = finished_shard(output, shard, dtype)
        if done is None:
            return False
        total += done["documents"]
        if total >= max_documents:
            return True
    return False


def write_manifest_if_complete(output: Path, plan: dict, shards: list[Shard], max_documents: int, log=print):
    """The manifest, written (renamed into place) when every shard a split needs is done: all of them, or with
    --max_documents the first ones holding that many documents (the last one cut at a document boundary)."""
    entries, counts = [], {}
    for split in dict.fromkeys(s.split for s in shards):
        docs_left = max_documents or None
        for shard in (s for s in shards if s.split == split):
            done = finished_shard(output, shard, plan["dtype"])
            if done is None:
                waiting = sum(finished_shard(output, s, plan["dtype"]) is None for s in shards)
                log(f"prepare: {waiting} of {len(shards)} shards not done yet; the task that finishes the last one "
                    "writes the manifest")
                return None
            documents, tokens = done["documents"], done["tokens"]
            if docs_left is not None and documents >= docs_left:
                offsets = np.load(output / SHARDS_DIR / f"{shard.name}.idx.npy", mmap_mode="r")
                documents, tokens = docs_left, int(offsets[docs_left])
            entries.append({"split": split, "name": shard.name, "tokens": tokens, "documents": documents,
                            "file": f"{SHARDS_DIR}/{shard.name}.bin", "index": f"{SHARDS_DIR}/{shard.name}.idx.npy"})
            split_counts = counts.setdefault(split, {"documents": 0, "tokens": 0})
            split_counts["documents"] += documents
            split_counts["tokens"] += tokens
            if docs_left is not None:
                docs_left -= documents
                if docs_left == 0:
                    break
    from .concat_dataset import DataError

    if not counts.get("train", {}).get("tokens"):
        raise DataError(Problem("--text_column", plan["text_column"], "the training split holds no text after "
                                "tokenization", "check that this column holds the documents' text"))
    manifest = {**{k: plan[k] for k in ("format", "version", "dataset", "source_kind", "source_identity",
                                        "dataset_config_name", "text_column", "max_documents", "tokenizer", "dtype")},
                "documents": {k: v["documents"] for k, v in counts.items()},
                "tokens": {k: v["tokens"] for k, v in counts.items()},
                "shards": entries, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    write_json_atomic(output / MANIFEST, manifest)
    log(f"prepare: wrote {output / MANIFEST}: " + "; ".join(
        f"{split} {c['documents']:,} documents, {c['tokens']:,} tokens" for split, c in counts.items())
        + f" in {len(entries)} shards ({manifest['dtype']})")
    return manifest


# --------------------------------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m model_utils.prepare", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", default=None, help="What --dataset of the trainer takes: files, a save_to_disk "
                   "directory or a hub dataset. Default: the embedded corpus.")
    p.add_argument("--dataset_config_name", default=None, help="Hub dataset configuration name.")
    p.add_argument("--local_dataset", default="auto", choices=("auto", "true", "false"))
    p.add_argument("--tokenizer", default=None, help="The tokenizer training will use (default: the shipped one).")
    p.add_argument("--output", required=True, help="Directory for the shards and manifest.json (shared by the "
                   "SLURM tasks).")
    p.add_argument("--num_proc", type=int, default=None, help="Tokenizing processes per task (default: the CPUs "
                   "this process may use).")
    p.add_argument("--text_column", default="text")
    p.add_argument("--max_documents", type=int, default=0, help="Only the first N documents of each split (0: all).")
    p.add_argument("--shard_mb", type=float, default=None, help="Input megabytes per shard (default: about 256 "
                   "shards, 1 to 256 MiB each).")
    p.add_argument("--data_cache_dir", default=None, help="Where hub downloads and the embedded corpus are cached.")
    return p.parse_args(argv)


def argument_problems(args) -> list[Problem]:
    problems = []
    if args.num_proc is not None and args.num_proc < 1:
        problems.append(Problem("--num_proc", args.num_proc, "must be at least 1", "pass --num_proc 1 or more"))
    if args.max_documents < 0:
        problems.append(Problem("--max_documents", args.max_documents, "must be >= 0", "pass 0 for all documents"))
    if args.shard_mb is not None and not args.shard_mb > 0:
        problems.append(Problem("--shard_mb", args.shard_mb, "must be positive", "leave it out for the default"))
    output = Path(args.output)
    if output.exists() and not output.is_dir():
        problems.append(Problem("--output", args.output, "is a file", "pass a directory"))
    return problems


def main(argv=None) -> int:
    from .config import DataConfig, exit_on_problems
    from .concat_dataset import DataError

    args = parse_args(argv)
    exit_on_problems(argument_problems(args))
    cfg = DataConfig(dataset=args.dataset, dataset_config_name=args.dataset_config_name,
                     local_dataset=args.local_dataset, text_column=args.text_column,
                     max_documents=args.max_documents, data_cache_dir=args.data_cache_dir, validation_fraction=0.0)
    try:
        prepare(cfg, args.tokenizer, Path(args.output), args.num_proc, args.shard_mb)
    except (DataError, PreparationFailed) as e:
        exit_on_problems([e.problem])
    except ValueError as e:  # load_tokenizer's message names the tokenizer and the fix
        print(f"error: {e}", file=sys.stderr)
        return BAD_INPUT
    return 0


if __name__ == "__main__":
    sys.exit(main())
