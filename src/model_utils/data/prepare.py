"""Preparing a corpus ahead of training (the `python -m model_utils.prepare` command, docs/DATA-PREPARATION.md): the
shards (shards.py) tokenized by a process pool with the fast tokenizer's batch encode, an EOS after every document,
each written as DIR/shards/<split>-NNNNN.bin (token ids, uint16 where the vocabulary fits) and .idx.npy (document
offsets) with a .done marker; SLURM tasks take every n-th shard, and the task that finds all of them done writes
DIR/manifest.json.
"""

from __future__ import annotations

import itertools
import os
import socket
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from model_utils.core.problems import Problem
from model_utils.data.errors import DataError
from model_utils.data.progress import Progress, read_json, record_failure, write_json_atomic
from model_utils.data.shards import Shard, plan_shards, shard_documents
from model_utils.data.sources import FORMAT, FORMAT_VERSION, MANIFEST, resolve_source
from model_utils.data.tokenizer import load_tokenizer
from model_utils.data.tokens import check_token_ids, ends_with_eos, token_dtype, tokenizer_identity

PLAN = "plan.json"
FAILURE = "FAILED.json"
SHARDS_DIR = "shards"
PROGRESS_DIR = "progress"


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

        return cls(eos, vocab_size, tokenizer=load_tokenizer(name))

    def encode_texts(self, texts: list[str]) -> list[list[int]]:
        if self.backend is not None:
            return [e.ids for e in self.backend.encode_batch(texts, add_special_tokens=False)]
        return self.tokenizer(texts, add_special_tokens=False)["input_ids"]

    def __call__(self, docs: list, where: str) -> list[list[int]]:
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
