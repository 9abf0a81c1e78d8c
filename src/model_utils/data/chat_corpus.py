"""The embedded fine-tuning datasets: chats about Python standard-library functions, and preference pairs made of
them, built offline.

Each example asks what a public function of the standard library does (its module, name and signature) and answers with
the function's docstring, taken by the same walk over this interpreter's standard library as the embedded pretraining
corpus (`data/corpus.py`). Like that corpus, it is built at run time into a cache directory, never committed, and is the
same for the same interpreter: the examples, their order, the wording of each question and the train/validation split
follow from the functions' qualified names alone.

The preference pairs (`embedded-preference`) are the chats, one pair per chat of each split: the chat's question, its
answer chosen and the same answer in capitals rejected. The held-out pairs ask the validation split's questions, which
neither fine-tuning on the chats nor tuning on the training pairs saw. It is a preference a tiny model learns within a
few steps, so that the CPU journey (docs/PREFERENCE.md) shows the whole road working.

    python -m model_utils.data.chat_corpus            # build (once) and print the directory holding the two JSONL files
"""

from __future__ import annotations

import argparse
import ast
import copy
import hashlib
import json
import os
import sys
import sysconfig
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from model_utils.data.corpus import MIN_DOCSTRING_CHARS, default_cache_root, place_once, stdlib_sources

DEFAULT_MAX_EXAMPLES = 4000
VALIDATION_PERCENT = 5  # of the examples, chosen by name: the split does not move when max_examples changes
QUESTIONS = (
    "What does `{call}` in the `{module}` module do?",
    "Explain the Python standard-library function `{module}.{call}`.",
    "I found `{call}` in `{module}`. How does it behave?",
    "Describe what `{module}.{call}` is for.",
)
SYSTEM_PROMPT = "You are a concise assistant that documents the Python standard library."
SPLITS = ("train", "validation")


@dataclass(frozen=True)
class DocumentedFunction:
    """A public function of the standard library with a docstring long enough to teach something."""

    module: str  # dotted module name, e.g. "json.decoder"
    name: str  # qualified within the module, e.g. "JSONDecoder.decode"
    signature: str  # the parameters as written, without self
    doc: str

    @property
    def key(self) -> str:
        return f"{self.module}.{self.name}"

    def digest(self) -> int:
        return int.from_bytes(hashlib.sha256(self.key.encode()).digest()[:8], "big")

    def messages(self) -> list[dict]:
        question = QUESTIONS[self.digest() % len(QUESTIONS)].format(call=f"{self.name}({self.signature})",
                                                                   module=self.module)
        return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question},
                {"role": "assistant", "content": self.doc}]


def module_name(path: Path, stdlib: Path) -> str:
    """The dotted module name of a standard-library source file (a package by its __init__.py)."""
    parts = list(path.relative_to(stdlib).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _signature(node: ast.FunctionDef | ast.AsyncFunctionDef, is_method: bool) -> str:
    """The parameters as written, without a method's self or cls (what a caller passes)."""
    arguments = copy.copy(node.args)
    if is_method and arguments.posonlyargs and arguments.posonlyargs[0].arg in ("self", "cls"):
        arguments.posonlyargs = arguments.posonlyargs[1:]
    elif is_method and arguments.args and arguments.args[0].arg in ("self", "cls"):
        arguments.args = arguments.args[1:]
    return ast.unparse(arguments)


def documented_functions(path: Path, stdlib: Path) -> Iterator[DocumentedFunction]:
    """The module's public top-level functions and public methods of its public classes that have a docstring of at
    least MIN_DOCSTRING_CHARS."""
    module = module_name(path, stdlib)
    if any(part.startswith("_") for part in module.split(".")):
        return
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", SyntaxWarning)
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return  # a few stdlib files are deliberately invalid (test data, encodings)
    functions = (ast.FunctionDef, ast.AsyncFunctionDef)

    def found(node, qualified: str, is_method: bool):
        doc = ast.get_docstring(node, clean=True)
        if doc and len(doc) >= MIN_DOCSTRING_CHARS:
            yield DocumentedFunction(module, qualified, _signature(node, is_method), doc)

    for node in tree.body:
        if isinstance(node, functions) and not node.name.startswith("_"):
            yield from found(node, node.name, False)
        elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            for member in node.body:
                if isinstance(member, functions) and not member.name.startswith("_"):
                    yield from found(member, f"{node.name}.{member.name}", True)


def select_examples(max_examples: int = DEFAULT_MAX_EXAMPLES) -> dict[str, list[DocumentedFunction]]:
    """{split: functions}: the first `max_examples` functions in the order of their names' digests (a spread over the
    whole library, the same on every run), each in validation when its digest says so (VALIDATION_PERCENT)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    unique = {}
    for path in stdlib_sources():
        for function in documented_functions(path, stdlib):
            unique.setdefault(function.key, function)  # a name defined twice (per platform): the first
    chosen = sorted(unique.values(), key=lambda f: (f.digest(), f.key))[:max_examples]
    splits = {split: [] for split in SPLITS}
    for function in chosen:
        splits["validation" if (function.digest() >> 8) % 100 < VALIDATION_PERCENT else "train"].append(function)
    return splits


def build_sft_corpus(cache_root: Path | None = None, max_examples: int = DEFAULT_MAX_EXAMPLES) -> Path:
    """Build (once) and return the directory holding `train.jsonl` and `validation.jsonl`, one `{"messages": ...}`
    chat per line. The key is the Python version, the stdlib location and the selection, so different interpreters
    never share a stale dataset; each file is written to a temporary name and put in place where no other process's is
    (corpus.place_once)."""
    return _built("sft-corpus", "", lambda splits: {split: [{"messages": f.messages()} for f in functions]
                                                    for split, functions in splits.items()}, cache_root, max_examples)


def _built(name: str, variant: str, rows_of, cache_root: Path | None, max_examples: int) -> Path:
    """The directory of one embedded dataset: `rows_of(select_examples(...))`, {split: rows}, written there once."""
    stdlib = sysconfig.get_paths()["stdlib"]
    key = hashlib.sha256(f"{sys.version}|{stdlib}|{MIN_DOCSTRING_CHARS}|{max_examples}|{QUESTIONS}|{SYSTEM_PROMPT}"
                         f"{variant}".encode()).hexdigest()[:12]
    out_dir = (cache_root or default_cache_root()) / f"{name}-py{sys.version_info.major}{sys.version_info.minor}-{key}"
    if all((out_dir / f"{split}.jsonl").exists() for split in SPLITS):
        return out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    for split, rows in rows_of(select_examples(max_examples)).items():
        tmp = out_dir / f"{split}.jsonl.tmp-{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
        place_once(tmp, out_dir / f"{split}.jsonl")
    return out_dir


def preference_rows(functions: list[DocumentedFunction]) -> list[dict]:
    """TRL's conversational preference rows: the chat's prompt (system and user turns), its answer as `chosen`, and as
    `rejected` the same answer with its words in reverse order: the same tokens, none of the language."""
    rows = []
    for function in functions:
        *prompt, answer = function.messages()
        rows.append({"prompt": prompt, "chosen": [answer],
                     "rejected": [{"role": "assistant", "content": answer["content"].upper()}]})
    return rows


def build_preference_corpus(cache_root: Path | None = None, max_examples: int = DEFAULT_MAX_EXAMPLES) -> Path:
    """Build (once) and return the directory holding the preference pairs' `train.jsonl` and `validation.jsonl`, one
    pair (`preference_rows`) per chat of each split, keyed like the chats."""
    return _built("preference-corpus", "|answers against them in capitals",
                  lambda splits: {split: preference_rows(functions) for split, functions in splits.items()},
                  cache_root, max_examples)


def split_files(corpus_dir: Path) -> dict[str, str]:
    """{split: JSONL file} of a built corpus, as `datasets.load_dataset("json", data_files=...)` takes them."""
    return {split: str(Path(corpus_dir) / f"{split}.jsonl") for split in SPLITS}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cache_root", type=Path, default=None)
    parser.add_argument("--max_examples", type=int, default=DEFAULT_MAX_EXAMPLES)
    parser.add_argument("--pairs", action="store_true", help="the preference pairs (embedded-preference)")
    arguments = parser.parse_args()
    build = build_preference_corpus if arguments.pairs else build_sft_corpus
    print(build(arguments.cache_root, arguments.max_examples))
