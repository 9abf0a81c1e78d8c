"""Throughput of the data preparation (model_utils.prepare) against the tokenizer's own limit.

    python benchmarks/prepare_throughput.py [--tokens 5e6] [--procs 1,2,N] [--tokenizer TOK]
        measures, on a synthetic corpus of about --tokens tokens it writes (the Python standard library's docstrings
        repeated, each copy numbered): the fast tokenizer's batch encode on one core (the most one tokenizing process
        can give), then the preparation's tokens/s with 1, 2 and N processes; prints a table.
    python benchmarks/prepare_throughput.py --generate 1e9 --output corpus.jsonl
        only writes a synthetic corpus of about that many tokens (JSONL, one document per line), to prepare and time
        a training run's first step on.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import common  # noqa: F401  (src/ on the import path)

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # one core per process, as the preparation's workers run

SAMPLE_DOCUMENTS = 200  # documents tokenized to estimate the corpus's tokens per byte


def generate_corpus(path: Path, tokens: float, tokenizer) -> dict:
    """Write about `tokens` tokens of JSONL: the embedded corpus's documents in turn, each copy prefixed with its
    number so that no two documents are the same text."""
    from model_utils.data.corpus import iter_documents

    docs = list(iter_documents())
    sample = docs[:SAMPLE_DOCUMENTS]
    sample_tokens = sum(len(x) + 1 for x in tokenizer(sample, add_special_tokens=False)["input_ids"])
    tokens_per_byte = sample_tokens / sum(len(d.encode()) for d in sample)
    target_bytes = tokens / tokens_per_byte
    written = documents = 0
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        while written < target_bytes:
            line = json.dumps({"text": f"Copy {documents // len(docs)}. {docs[documents % len(docs)]}"}) + "\n"
            f.write(line)
            written += len(line.encode())
            documents += 1
    os.replace(tmp, path)
    return {"path": str(path), "documents": documents, "bytes": written, "tokens_estimated": int(written * tokens_per_byte)}


def one_core_encode(path: Path, tokenizer, limit_tokens: float = 2e6) -> float:
    """Tokens per second of the fast tokenizer's batch encode in this process on one core, on the corpus's first
    `limit_tokens` or so."""
    from model_utils.data.prepare import Encoder
    from model_utils.data.shards import ENCODE_BATCH

    encoder = Encoder.from_spec(Encoder.spec(tokenizer, None))
    texts, size = [], 0
    with open(path, encoding="utf-8") as f:
        for line in f:
            texts.append(json.loads(line)["text"])
            size += len(texts[-1]) / 4
            if size > limit_tokens:
                break
    started, tokens = time.perf_counter(), 0
    for i in range(0, len(texts), ENCODE_BATCH):
        tokens += sum(len(x) for x in encoder(texts[i:i + ENCODE_BATCH], str(path)))
    return tokens / (time.perf_counter() - started)


def prepare_rate(path: Path, processes: int, workdir: Path) -> tuple[float, int]:
    """(tokens/s, tokens) of a whole preparation of `path` with `processes` tokenizing processes, from scratch."""
    from model_utils.config.settings import DataConfig
    from model_utils.data.prepare import prepare

    output = workdir / f"prepared-{processes}"
    started = time.perf_counter()
    manifest = prepare(DataConfig(dataset=str(path)), None, output, num_proc=processes, log=lambda *_: None,
                       stream=open(os.devnull, "w"))
    return manifest["tokens"]["train"] / (time.perf_counter() - started), manifest["tokens"]["train"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=float, default=5e6, help="Size of the synthetic corpus measured on.")
    p.add_argument("--procs", default=None, help="Comma-separated process counts (default: 1, 2 and the CPUs).")
    p.add_argument("--tokenizer", default=None, help="Tokenizer (default: the shipped one).")
    p.add_argument("--generate", type=float, default=None, help="Only write a corpus of about this many tokens.")
    p.add_argument("--output", default=None, help="Where --generate writes (a .jsonl file).")
    p.add_argument("--workdir", default=None, help="Folder for the measured corpus and preparations (default: a "
                   "temporary one, removed).")
    args = p.parse_args(argv)
    from model_utils.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(args.tokenizer)
    if args.generate:
        if not args.output:
            p.error("--generate needs --output FILE.jsonl")
        print(json.dumps(generate_corpus(Path(args.output), args.generate, tokenizer)))
        return 0
    cpus = len(os.sched_getaffinity(0))
    procs = [int(x) for x in args.procs.split(",")] if args.procs else sorted({1, min(2, cpus), cpus})
    if args.workdir:
        Path(args.workdir).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        corpus = generate_corpus(Path(tmp) / "corpus.jsonl", args.tokens, tokenizer)
        limit = one_core_encode(Path(corpus["path"]), tokenizer)
        rows = [("tokenizer batch encode, 1 core", 1, limit, None)]
        for n in procs:
            rate, tokens = prepare_rate(Path(corpus["path"]), n, Path(tmp))
            rows.append((f"prepare, {n} process{'es' if n > 1 else ''}", n, rate, tokens))
    print(f"corpus: {corpus['documents']:,} documents, {corpus['bytes'] / 1e6:.1f} MB, ~{corpus['tokens_estimated']:,} "
          f"tokens; {cpus} CPUs available; tokenizer {args.tokenizer or 'default'}")
    print(f"{'measured':34} {'tokens/s':>12} {'per process':>12} {'of 1-core limit':>16}")
    for name, n, rate, _ in rows:
        print(f"{name:34} {rate:12,.0f} {rate / n:12,.0f} {rate / n / limit:15.0%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
