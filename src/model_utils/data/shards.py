"""A corpus cut into shards that preparation tasks tokenize independently: byte ranges of JSONL and text files, row
groups of Parquet files, row ranges of Arrow datasets, each read document by document.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from dataclasses import dataclass
from pathlib import Path

from model_utils.core.problems import Problem
from model_utils.data.errors import DataError
from model_utils.data.loading import load_splits

MIN_SHARD_BYTES, MAX_SHARD_BYTES, TARGET_SHARDS = 1 << 20, 256 << 20, 256


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


ENCODE_BATCH = 1000  # documents per batch encode
