"""Reading a source's documents through datasets' loaders: its splits (a validation split where it has one), the first
documents for the preflight, and a load that fails turned into a Problem naming the file, the line and the fix.
"""

from __future__ import annotations

import os
from pathlib import Path

from model_utils.config.settings import TrainConfig
from model_utils.core.problems import Problem
from model_utils.data.errors import LOAD_ERRORS, DataError
from model_utils.data.sources import FILE_BUILDERS, DataSource

VALIDATION_SPLIT_NAMES = ("validation", "valid", "val", "dev")


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
def parse_errors() -> tuple:
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
                                           cache_dir=hf_cache_dir(cfg))
        except parse_errors() as e:
            raise load_problem(source, e) from e
    else:
        try:
            loaded = datasets.load_dataset(source.location, cfg.dataset_config_name, cache_dir=hf_cache_dir(cfg))
        except LOAD_ERRORS as e:
            raise load_problem(source, e) from e
    if isinstance(loaded, datasets.Dataset):
        loaded = datasets.DatasetDict({"train": loaded})
    train_name, val_name = split_names(list(loaded))
    splits = loaded[train_name], (loaded[val_name] if val_name else None)
    if cfg.max_documents:
        splits = tuple(s.select(range(min(cfg.max_documents, len(s)))) if s is not None else None for s in splits)
    return splits


def split_names(names: list[str]) -> tuple[str, str | None]:
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
    for split in split_names(names):
        if split is None:
            splits.append(None)
            continue
        try:
            # The source's identity is part of the generator's arguments, so datasets' own cache of this Arrow
            # dataset changes with the files.
            splits.append(datasets.Dataset.from_generator(
                stream_documents, cache_dir=hf_cache_dir(cfg),
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


def hf_cache_dir(cfg: TrainConfig) -> str | None:
    return os.path.join(cfg.data_cache_dir, "hf") if cfg.data_cache_dir else None
