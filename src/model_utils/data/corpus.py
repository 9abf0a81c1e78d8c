"""The embedded default corpus: real English text built offline from this machine's Python standard library.

Every Python installation ships thousands of docstrings written in plain English. Collecting them gives a corpus of a
few megabytes that needs no download, so the default run trains anywhere. The text is written by others, so it is built
at run time into a cache directory and never committed.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import sys
import sysconfig
import warnings
from pathlib import Path

# Documentation shorter than this is mostly one-line stubs ("Return self.") that teach a model little.
MIN_DOCSTRING_CHARS = 60
SKIPPED_DIRS = {"test", "tests", "idlelib", "site-packages", "dist-packages", "__pycache__", "turtledemo", "lib2to3"}


def default_cache_root() -> Path:
    """Where derived data (the embedded corpus, packed token files) is cached unless `--data_cache_dir` says otherwise."""
    root = os.environ.get("DEEPSPEED_LM_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "deepspeed-lm"
    )
    return Path(root)


def stdlib_sources() -> list[Path]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for path in sorted(stdlib.rglob("*.py")):
        if SKIPPED_DIRS.intersection(path.relative_to(stdlib).parts[:-1]):
            continue
        files.append(path)
    return files


def _docstrings(path: Path) -> list[str]:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", SyntaxWarning)
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return []  # a few stdlib files are deliberately invalid (test data, encodings)
    docs = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=True)
            if doc and len(doc) >= MIN_DOCSTRING_CHARS:
                docs.append(doc)
    return docs


def iter_documents():
    """Yield one document per source file: its long docstrings joined by blank lines, in a fixed order."""
    for path in stdlib_sources():
        docs = _docstrings(path)
        if docs:
            yield "\n\n".join(docs)


def build_embedded_corpus(cache_root: Path | None = None) -> Path:
    """Build (once) and return the path of `corpus.jsonl`, one `{"text": ...}` document per line.

    The cache key is the Python version and stdlib location, so different interpreters never share a stale corpus.
    The file is written to a temporary name and linked into place only where no other process put one there first:
    a crash never leaves a half-written corpus behind, and a corpus another process is already reading is never
    replaced under it (its tokenization would see the file change and stop).
    """
    stdlib = sysconfig.get_paths()["stdlib"]
    key = hashlib.sha256(f"{sys.version}|{stdlib}|{MIN_DOCSTRING_CHARS}".encode()).hexdigest()[:12]
    out_dir = (cache_root or default_cache_root()) / f"embedded-corpus-py{sys.version_info.major}{sys.version_info.minor}-{key}"
    corpus = out_dir / "corpus.jsonl"
    if corpus.exists():
        return corpus
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / f"corpus.jsonl.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        for doc in iter_documents():
            f.write(json.dumps({"text": doc}, ensure_ascii=False) + "\n")
    place_once(tmp, corpus)
    return corpus


def place_once(tmp: Path, path: Path) -> None:
    """Move a finished `tmp` to `path` unless another process put a file there first, which then stays: a file that a
    process may already be reading (the embedded datasets' caches, built by whichever process comes first) is never
    replaced under it."""
    try:
        os.link(tmp, path)  # fails where the other process's file got there first
    except FileExistsError:
        pass
    except OSError:  # a filesystem without hard links
        if not path.exists():
            os.replace(tmp, path)
    tmp.unlink(missing_ok=True)
