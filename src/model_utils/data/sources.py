"""What --dataset names, decided before anything is read: the embedded corpora, a save_to_disk directory, text, JSONL,
Parquet, CSV or Arrow files, token files, a prepared directory (prepare.py's manifest), a mixture, a hub dataset, or
any of those read as a stream. A wrong path or a mixed directory is a DataError with its fix.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from model_utils.config.settings import TrainConfig
from model_utils.core.problems import Problem
from model_utils.data.chat_corpus import build_preference_corpus, build_sft_corpus, split_files
from model_utils.data.corpus import build_embedded_corpus
from model_utils.data.errors import DataError
from model_utils.data.progress import read_json
from model_utils.data.vision.shapes import build_vision_corpus

FILE_BUILDERS = {".txt": "text", ".text": "text", ".md": "text", ".json": "json", ".jsonl": "json",
                 ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}


# --------------------------------------------------------------------------------------------------------------------
# Where the data comes from
# --------------------------------------------------------------------------------------------------------------------
@dataclass
class DataSource:
    # "disk" (save_to_disk), "files", "hub", "embedded", "prepared" (model_utils.prepare's manifest), "npy" (token
    # files), "mixture" (parts with weights), "stream" (--streaming: hub or files read as a stream, data/streaming.py)
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


def with_dataset(cfg, dataset: str):
    """The data settings of one part of a mixture."""
    return dataclasses.replace(cfg, dataset=dataset)


def _is_saved_dataset(path: Path) -> bool:
    return (path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists() or (path / "state.json").exists()


def resolve_source(cfg: TrainConfig) -> DataSource:
    """Decide what DATASET means, or raise DataError naming the setting and the fix."""
    if cfg.streaming:

        return resolve_stream(cfg, resolve_source(dataclasses.replace(cfg, streaming=False)))
    if not cfg.dataset or cfg.dataset == "embedded":
        corpus = build_embedded_corpus(Path(cfg.data_cache_dir) if cfg.data_cache_dir else None)
        return DataSource("embedded", str(corpus), files=[str(corpus)], builder="json")
    embedded = {"embedded-chat": build_sft_corpus, "embedded-preference": build_preference_corpus,
                "embedded-vision": build_vision_corpus}
    if cfg.dataset in embedded and not Path(cfg.dataset).exists():
        corpus = embedded[cfg.dataset](Path(cfg.data_cache_dir) if cfg.data_cache_dir else None)
        return DataSource(cfg.dataset, str(corpus), files=list(split_files(corpus).values()), builder="json")

    mixture = parse_mixture(cfg.dataset)
    if mixture is not None:
        return DataSource("mixture", cfg.dataset, parts=[(resolve_source(with_dataset(cfg, path)), weight)
                                                         for path, weight in mixture])
    path = Path(cfg.dataset)
    if path.is_dir() and (path / "manifest.json").exists():

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


FORMAT = "deepspeed-lm-prepared-tokens"


FORMAT_VERSION = 1


MANIFEST = "manifest.json"


def is_prepared(path: str | os.PathLike) -> bool:
    """A directory that holds this format's manifest."""
    manifest = read_json(Path(path) / MANIFEST) if Path(path).is_dir() else None
    return manifest is not None and manifest.get("format") == FORMAT


STREAMED_KINDS = ("hub", "files", "embedded")


# --------------------------------------------------------------------------------------------------------------------
# The source
# --------------------------------------------------------------------------------------------------------------------
def resolve_stream(cfg, source: DataSource) -> DataSource:
    """--streaming: the resolved `source` read as a stream (kind "stream"; `files` None for a hub dataset), or a
    DataError for data that is on this machine already in a form read without tokenizing."""
    if source.kind not in STREAMED_KINDS:
        what = {"disk": "a save_to_disk dataset", "prepared": "a prepared directory (model_utils.prepare)",
                "npy": "token files", "mixture": "a mixture"}[source.kind]
        raise DataError(Problem("--streaming", True, f"--dataset {source.location} is {what}, which the run reads "
                                "from this machine without downloading or streaming it",
                                "drop --streaming, or point --dataset at a hub dataset or text/JSONL/Parquet files"))
    return DataSource("stream", source.location, files=source.files, builder=source.builder)


MIXTURE_KEY = "mixture"


_WEIGHTED = re.compile(r"^(?P<dataset>.+):(?P<weight>[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)$")


def parse_mixture(spec: str) -> list[tuple[str, float]] | None:
    """(dataset, weight) pairs when `spec` names a mixture, else None (one dataset). Raises DataError on a
    malformed mixture."""
    if spec.endswith(".json") and os.path.isfile(spec):
        try:
            content = json.loads(Path(spec).read_text())
        except (json.JSONDecodeError, UnicodeDecodeError):
            return None  # a JSON dataset file that is not one document: a dataset, not a mixture
        if not isinstance(content, dict) or MIXTURE_KEY not in content:
            return None
        entries = content[MIXTURE_KEY]
        if not isinstance(entries, list) or not all(isinstance(e, dict) and "dataset" in e for e in entries):
            raise DataError(Problem("--dataset", spec, f'"{MIXTURE_KEY}" must be a list of {{"dataset": ..., '
                                    '"weight": ...}} objects', 'write e.g. {"mixture": [{"dataset": "a.jsonl", '
                                    '"weight": 0.7}, {"dataset": "b", "weight": 0.3}]}'))
        here = Path(spec).parent
        pairs = [(str(here / e["dataset"]) if (here / e["dataset"]).exists() else e["dataset"], e.get("weight", 1.0))
                 for e in entries]
    elif os.path.exists(spec) or not ("," in spec or _WEIGHTED.match(spec)):
        return None
    else:
        pairs = []
        for entry in spec.split(","):
            match = _WEIGHTED.match(entry.strip())
            if not match:
                raise DataError(Problem("--dataset", spec, f"the mixture's part '{entry}' has no weight",
                                        'write every part as DATASET:WEIGHT, e.g. "a.jsonl:0.7,b_dir:0.3"'))
            pairs.append((match["dataset"], float(match["weight"])))
    for dataset, weight in pairs:
        if not isinstance(weight, (int, float)) or not weight > 0:
            raise DataError(Problem("--dataset", spec, f"the weight of {dataset} is {weight!r}",
                                    "give every part a positive weight"))
    if len({d for d, _ in pairs}) != len(pairs):
        raise DataError(Problem("--dataset", spec, "names a dataset twice", "list each dataset once with its weight"))
    return [(d, float(w)) for d, w in pairs]
