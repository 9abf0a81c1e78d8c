"""Streamed data (--streaming): a dataset too big to download, read with `datasets.load_dataset(..., streaming=True)`
(a hub id, or local text/JSONL/Parquet files: the same IterableDataset path), tokenized and packed on the fly.

Rules (each rank, deterministically):
  documents   rank r of W reads its own documents: `datasets.distributed.split_dataset_by_node(stream, r, W)` (whole
              shards when the shard count divides by W, else every W-th document). No rank tokenizes another's
              documents, and no rank downloads another's shards where the shards divide.
  held out    without a validation split, a document whose digest (text, or ids) falls below --validation_fraction is
              validation, never training: a rule that needs no position, so it holds for any sharding.
  blocks      the rank's documents, tokenized with an EOS after each (data.tokens.tokenize_split's rule), are cut
              into blocks of seq_len + 1 tokens overlapping by one (PackedTokens' rule). At the end of its share the
              rank starts it again (the next epoch); the tokens run on across the seam.
  shuffle     a buffer of --stream_shuffle_blocks blocks per rank: each block read replaces a block drawn from the
              buffer by a generator seeded with (--seed, rank). 0: the stream's own order.
  order       global micro-batch k is W*m blocks: rank r reads its next m blocks, named k*W*m + r*m + j in --trace_data
              (the numbering BlockOrder gives positions), so names never repeat across ranks or steps.
  validation  the first VALIDATION_BLOCKS blocks of the validation split, else of the held-out documents, read by rank
              0 and broadcast.

Resume: each rank's place in the stream goes into its per-rank file of the checkpoint (rng_state_rankNNNNN.pt, key
"data_stream"): the IterableDataset's state_dict() after the last document read, the tokens read and not yet in a
block, the shuffle buffer and its generator, the epoch and the blocks read. Restored, the rank reads the same blocks in
the same order as an uninterrupted run. The documents each rank reads depend on the world size, so a resume with
another world size (or another --stream_shuffle_blocks, or without --streaming) is refused (stream_resume_problems).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from model_utils.core.problems import Problem
from model_utils.data.blocks import DataPosition, PackedTokens
from model_utils.data.errors import LOAD_ERRORS, DataError
from model_utils.data.loading import load_problem, parse_errors, split_names
from model_utils.data.sources import FILE_BUILDERS, DataSource
from model_utils.data.tokens import check_token_ids, ends_with_eos

DOCUMENTS_PER_READ = 64  # documents per tokenizer call
VALIDATION_BLOCKS = 128  # validation blocks every evaluation picks from
VALIDATION_SCAN_DOCUMENTS = 200_000  # the held-out documents are looked for among this many at most
SAMPLE_DOCUMENTS = 64  # what the preflight reads of a stream
STATE_KEY = "data_stream"  # the stream's entry in each rank's per-rank checkpoint file


def _origin(source: DataSource) -> DataSource:
    """The stream's source as concat_dataset names it (for load_problem's messages)."""
    return DataSource("files" if source.files else "hub", source.location, files=source.files, builder=source.builder)


def stream_identity(cfg, source: DataSource) -> dict:
    """What the stream's position is counted in, computed without reading it: the files (names, sizes, times) or the
    hub dataset and its configuration, the column and the held-out rule."""
    if source.files:
        where = [(f, os.path.getsize(f), int(os.path.getmtime(f))) for f in source.files]
    else:
        where = [source.location, cfg.dataset_config_name]
    held_out = 0.0 if _validation_split(cfg, source, quiet=True) else cfg.validation_fraction
    body = json.dumps(["stream", where, cfg.text_column, held_out])
    return {"dataset": cfg.dataset or "the embedded corpus",
            "fingerprint": hashlib.sha256(body.encode()).hexdigest()[:16]}


def _load(cfg, source: DataSource, split: str | None):
    """The stream of a split (None: the splits it has, as an IterableDatasetDict)."""
    import datasets

    location = source.location if not source.files else (source.builder or FILE_BUILDERS[Path(source.files[0]).suffix])
    data_files = {"train": source.files} if source.files else None
    name = None if source.files else cfg.dataset_config_name
    try:
        return datasets.load_dataset(location, name, data_files=data_files, split=split, streaming=True)
    except (*LOAD_ERRORS, *parse_errors()) as e:
        raise load_problem(_origin(source), e) from e


def _validation_split(cfg, source: DataSource, quiet: bool = False) -> str | None:
    """The stream's validation split, if it has one (local files have none)."""
    if source.files:
        return None
    try:
        return split_names(list(_load(cfg, source, None)))[1]
    except DataError:
        if quiet:
            return None
        raise


def _train_split(cfg, source: DataSource) -> str:
    return "train" if source.files else split_names(list(_load(cfg, source, None)))[0]


def held_out(document: dict, text_column: str, fraction: float) -> bool:
    """Whether a document is validation: its digest, as a fraction of the digests' range, falls below `fraction`."""
    if fraction <= 0:
        return False
    value = document.get(text_column)
    body = value.encode() if isinstance(value, str) else np.asarray(document.get("input_ids") or [], np.int64).tobytes()
    return int.from_bytes(hashlib.blake2b(body, digest_size=8).digest(), "little") < fraction * 2 ** 64


# --------------------------------------------------------------------------------------------------------------------
# Tokens of documents, and blocks of tokens
# --------------------------------------------------------------------------------------------------------------------
class DocumentTokens:
    """Documents -> token ids, an EOS after each non-empty document (text), or the ids given (`input_ids`, checked
    against the vocabulary), as data.tokens.tokenize_split makes them."""

    def __init__(self, tokenizer, text_column: str, what: str):
        self.tokenizer, self.text_column, self.what = tokenizer, text_column, what
        self.eos, self.vocab = tokenizer.eos_token_id, len(tokenizer)

    def __call__(self, documents: list[dict]) -> np.ndarray:
        if not documents:
            return np.zeros(0, np.int64)
        first = documents[0]
        if self.text_column not in first and "input_ids" in first:
            ids = [ends_with_eos(d.get("input_ids") or [], self.eos) for d in documents]
            tokens = np.concatenate([np.asarray(x, np.int64) for x in ids]) if ids else np.zeros(0, np.int64)
            check_token_ids(tokens, self.vocab, "--dataset", f"the `input_ids` column of {self.what}")
            return tokens
        if self.text_column not in first:
            raise DataError(Problem("--text_column", self.text_column, f"{self.what} has no such column (columns: "
                                    f"{', '.join(first)})", "pass --text_column with one of those"))
        texts = [d.get(self.text_column) if isinstance(d.get(self.text_column), str) else "" for d in documents]
        ids = self.tokenizer(texts, add_special_tokens=False)["input_ids"]
        pieces = [np.asarray(x + [self.eos], np.int64) for x in ids if x]
        return np.concatenate(pieces) if pieces else np.zeros(0, np.int64)


class StreamReader:
    """One rank's blocks of the stream, read in order (`batch`), with the state that continues them exactly
    (`state_dict`, `load_state_dict`). `open_documents()` gives the rank's document stream from its start."""

    def __init__(self, source: DataSource, open_documents, tokens: DocumentTokens, seq_len: int, rank: int,
                 world: int, shuffle_blocks: int, seed: int, held_out_fraction: float):
        self.source, self.open_documents, self.tokens, self.seq_len = _origin(source), open_documents, tokens, seq_len
        self.rank, self.world, self.shuffle_blocks, self.seed = rank, world, shuffle_blocks, seed
        self.held_out_fraction = held_out_fraction
        self.micro = 1  # blocks per rank per micro-batch (StreamOrder sets it): the names the blocks read carry
        self.rng = np.random.default_rng([seed, rank])
        self.buffer: list[np.ndarray] = []
        self.pending = np.zeros(0, np.int64)  # tokens read, not yet all in blocks (a block's last starts the next)
        self.epoch, self.blocks_read, self.documents_read, self.epoch_tokens = 0, 0, 0, 0
        self.stream_state = None  # the IterableDataset's state after the last document read (None: its start)
        self._dataset = self._iterator = None

    # --- reading ---
    def _start(self):
        self._dataset = self.open_documents()
        if self.stream_state is not None:
            self._dataset.load_state_dict(self.stream_state)
        self._iterator = iter(self._dataset)

    def _read_documents(self) -> None:
        """Tokenize the rank's next documents onto `pending`; at the end of its share, start the next epoch."""
        if self._iterator is None:
            self._start()
        documents, ended = [], False
        while len(documents) < DOCUMENTS_PER_READ:
            try:
                document = next(self._iterator)
            except StopIteration:
                ended = True
                break
            except parse_errors() as e:  # a file (or a hub shard) that does not parse, met mid-run
                raise load_problem(self.source, e) from e
            self.documents_read += 1
            if not held_out(document, self.tokens.text_column, self.held_out_fraction):
                documents.append(document)
        new = self.tokens(documents)
        self.epoch_tokens += len(new)
        if ended:
            if self.epoch_tokens == 0:
                raise DataError(Problem("--dataset", self.source.location, f"rank {self.rank}'s share of the stream "
                                        f"({self.world} ranks) holds no training tokens",
                                        "use more data (more documents or shards), or fewer ranks"))
            self.epoch += 1
            self.epoch_tokens, self.documents_read, self.stream_state = 0, 0, None
            self._start()
        else:
            self.stream_state = self._dataset.state_dict()
        self.pending = np.concatenate([self.pending, new])

    def _next_packed(self) -> np.ndarray:
        """The next block of seq_len + 1 tokens; the next one starts at its last token."""
        while len(self.pending) < self.seq_len + 1:
            self._read_documents()
        block = self.pending[:self.seq_len + 1].copy()
        self.pending = self.pending[self.seq_len:]
        return block

    def next_block(self) -> np.ndarray:
        if self.shuffle_blocks == 0:
            return self._next_packed()
        while len(self.buffer) < self.shuffle_blocks:
            self.buffer.append(self._next_packed())
        slot = int(self.rng.integers(self.shuffle_blocks))
        block, self.buffer[slot] = self.buffer[slot], self._next_packed()
        return block

    def next_name(self) -> int:
        """The name of the next block this rank reads (the order's numbering)."""
        group, offset = divmod(self.blocks_read, self.micro)
        return group * self.world * self.micro + self.rank * self.micro + offset

    def batch(self, names) -> np.ndarray:
        """The rank's next len(names) blocks; `names` must be the ones StreamOrder gives for this place."""
        if len(names) and int(names[0]) != self.next_name():
            raise RuntimeError(f"rank {self.rank}'s stream is at block {self.next_name()}, and the step asks for block "
                               f"{int(names[0])}: the data position and the stream's state disagree")
        blocks = np.stack([self.next_block() for _ in names])
        self.blocks_read += len(names)
        return blocks

    # --- state ---
    def state_dict(self) -> dict:
        """This rank's place in the stream (copies: the reader goes on while a background save writes them)."""
        return {"version": 1, "rank": self.rank, "world_size": self.world, "seq_len": self.seq_len,
                "shuffle_blocks": self.shuffle_blocks, "epoch": self.epoch, "blocks_read": self.blocks_read,
                "documents_read": self.documents_read, "epoch_tokens": self.epoch_tokens,
                "stream": json.loads(json.dumps(self.stream_state)) if self.stream_state is not None else None,
                # token ids fit 32 bits: half the bytes of the reader's int64 in every checkpoint
                "pending": self.pending.astype(np.uint32),
                "buffer": np.stack(self.buffer).astype(np.uint32) if self.buffer else np.zeros((0, self.seq_len + 1),
                                                                                               np.uint32),
                "rng": self.rng.bit_generator.state}

    def load_state_dict(self, state: dict) -> None:
        for key, mine in (("world_size", self.world), ("rank", self.rank), ("seq_len", self.seq_len),
                          ("shuffle_blocks", self.shuffle_blocks)):
            if state[key] != mine:  # the preflight refuses these resumes; a state that slips through stops here
                raise RuntimeError(f"the checkpoint's stream state has {key} {state[key]}, this run {mine}")
        self.epoch, self.blocks_read = int(state["epoch"]), int(state["blocks_read"])
        self.documents_read, self.epoch_tokens = int(state["documents_read"]), int(state["epoch_tokens"])
        self.stream_state = state["stream"]
        self.pending = np.asarray(state["pending"], np.int64)
        self.buffer = [np.asarray(row, np.int64) for row in state["buffer"]]
        self.rng.bit_generator.state = state["rng"]
        self._dataset = self._iterator = None  # reopened at the saved state on the next read


@dataclass
class StreamOrder:
    """BlockOrder's interface for a stream: global micro-batch k gives rank r the names k*W*m + r*m + [0, m)."""

    reader: StreamReader
    world_size: int
    micro_batch: int

    def __post_init__(self):
        self.reader.micro = self.micro_batch

    def rank_indices(self, position: DataPosition, rank: int) -> np.ndarray:
        start = position.blocks_consumed + rank * self.micro_batch
        return np.arange(start, start + self.micro_batch, dtype=np.int64)

    def advance(self, position: DataPosition) -> DataPosition:
        return DataPosition(position.epoch, position.blocks_consumed + self.world_size * self.micro_batch)


@dataclass
class StreamedData:
    """PackedData's interface for a stream: `train` reads the rank's blocks in order, `val`/`val_ids` are blocks in
    memory, `train_tokens` is unknown (None)."""

    train: StreamReader
    val: PackedTokens
    val_ids: np.ndarray
    description: str
    identity: dict
    train_tokens = None

    def order(self, world_size: int, micro_batch: int) -> StreamOrder:
        return StreamOrder(self.train, world_size, micro_batch)


# --------------------------------------------------------------------------------------------------------------------
# Opening a stream for the run, and the preflight's look at it
# --------------------------------------------------------------------------------------------------------------------
def open_stream(cfg, source: DataSource, tokenizer, seq_len: int, dist, log=print, seed: int = 0) -> StreamedData:
    """This rank's stream of training blocks, and the validation blocks (rank 0 reads them, every rank holds them)."""
    from datasets.distributed import split_dataset_by_node

    # the ranks of a sequence-parallel group read one stream (each keeps its slice of every sequence)
    rank, world = (dist.data_rank, dist.data_world) if dist is not None else (0, 1)
    train_split, validation_split = _train_split(cfg, source), _validation_split(cfg, source)
    fraction = 0.0 if validation_split else cfg.validation_fraction
    first = _load(cfg, source, train_split)
    shards = first.num_shards

    def open_documents():
        return split_dataset_by_node(_load(cfg, source, train_split), rank=rank, world_size=world)

    reader = StreamReader(source, open_documents, DocumentTokens(tokenizer, cfg.text_column, source.location), seq_len,
                          rank, world, cfg.stream_shuffle_blocks, seed, fraction)
    validation = None
    if dist is None or dist.is_main:
        validation = validation_tokens(cfg, source, tokenizer, seq_len, validation_split, fraction)
    if dist is not None:
        validation = dist.broadcast_object(validation)
    val = PackedTokens(validation, seq_len)
    where = "the validation split" if validation_split else (f"documents held out by digest (--validation_fraction "
                                                             f"{fraction})" if fraction > 0 else "none")
    split_rule = "whole shards" if shards % world == 0 else "every one of its documents in turn"
    description = (f"{source.location} streams (--streaming, {shards} shard(s)): each of {world} rank(s) reads its own "
                   f"documents ({split_rule}), packed on the fly into blocks of {seq_len}, "
                   + (f"shuffled in a buffer of {cfg.stream_shuffle_blocks} blocks (seed {seed})"
                      if cfg.stream_shuffle_blocks else "in the stream's order")
                   + f"; validation: {val.num_blocks} blocks of {where}")
    return StreamedData(reader, val, np.arange(val.num_blocks), description, stream_identity(cfg, source))


def validation_tokens(cfg, source: DataSource, tokenizer, seq_len: int, split: str | None,
                      fraction: float) -> np.ndarray:
    """The tokens of the first VALIDATION_BLOCKS validation blocks: of the validation split, else of the documents
    held out of training."""
    if split is None and fraction <= 0:
        return np.zeros(0, np.int64)
    stream = _load(cfg, source, split or _train_split(cfg, source))
    tokens = DocumentTokens(tokenizer, cfg.text_column, source.location)
    wanted, pieces, count, documents = VALIDATION_BLOCKS * seq_len + 1, [], 0, []
    for scanned, document in enumerate(stream):
        if scanned >= VALIDATION_SCAN_DOCUMENTS:
            break
        if split is None and not held_out(document, cfg.text_column, fraction):
            continue
        documents.append(document)
        if len(documents) == DOCUMENTS_PER_READ:
            pieces.append(tokens(documents))
            count, documents = count + len(pieces[-1]), []
            if count >= wanted:
                break
    pieces.append(tokens(documents))
    return np.concatenate(pieces)[:wanted]


def describe_stream(cfg, source: DataSource, tokenizer) -> str:
    """The preflight's data line for a stream: its first documents read (nothing downloaded whole), the column
    checked and tokenized. Raises DataError as the run would."""
    split = _train_split(cfg, source)
    try:
        documents = list(_load(cfg, source, split).take(SAMPLE_DOCUMENTS))
    except parse_errors() as e:
        raise load_problem(_origin(source), e) from e
    if not documents:
        raise DataError(Problem("--dataset", source.location, "is empty", "point --dataset at data with documents"))
    tokens = DocumentTokens(tokenizer, cfg.text_column, source.location)(documents)
    if len(tokens) == 0:
        raise DataError(Problem("--text_column", cfg.text_column, "the first documents of the stream hold no text",
                                "check the column's contents"))
    return (f"data: {source.location} streams (--streaming): column '{cfg.text_column}' present; its first "
            f"{len(documents)} documents hold {len(tokens) / len(documents):,.0f} tokens each on average; the training "
            "blocks are counted as they are read, not in advance")


# --------------------------------------------------------------------------------------------------------------------
# The trainer's hooks: the per-rank state in checkpoints, and the resumes it can continue
# --------------------------------------------------------------------------------------------------------------------
def is_streamed(data) -> bool:
    return isinstance(data, StreamedData)


def with_stream_state(rank_state: dict, data) -> dict:
    """The rank's per-rank checkpoint file contents (its RNG state), with its place in the stream when it streams."""
    return {**rank_state, STATE_KEY: data.train.state_dict()} if is_streamed(data) else rank_state


def resume_stream(data, rank_state: dict | None, path: Path, log) -> None:
    """Put the rank's stream where the checkpoint's per-rank file left it (nothing for data that does not stream)."""
    if not is_streamed(data):
        return
    if not rank_state or STATE_KEY not in rank_state:
        raise DataError(Problem("--streaming", True, f"{path} holds no stream position for rank {data.train.rank}",
                                "resume from a checkpoint of a streamed run with the same ranks, or start a new run "
                                "in another --checkpoint_dir"))
    data.train.load_state_dict(rank_state[STATE_KEY])
    reader = data.train
    log(f"resume: the stream continues at epoch {reader.epoch}, {reader.blocks_read} blocks read by rank "
        f"{reader.rank}, {len(reader.pending)} tokens carried into the next block")


def stream_resume_problems(manifest: dict, path: Path, streaming: bool, shuffle_blocks: int, world: int) -> list:
    """What makes a checkpoint's data position unusable for this run on a stream: a stream position for data read
    from the token cache or the other way round, another world size (each rank reads its own documents), another
    shuffle buffer. Checkpoints without a data entry are not compared."""
    data = manifest.get("data")
    if not isinstance(data, dict):
        return []
    saved = data.get("streamed")
    fix = "or start a new run in another --checkpoint_dir"
    if saved is None and streaming:
        return [Problem("--streaming", True, f"{path} was trained on data read whole (its position is a place in "
                        "a block order), which a stream cannot continue", f"resume without --streaming, {fix}")]
    if saved is not None and not streaming:
        return [Problem("--streaming", False, f"{path} was trained on a stream (its position is each rank's place in "
                        "it)", f"resume with --streaming, {fix}")]
    if saved is None:
        return []
    problems = []
    if saved.get("world_size") != world:
        problems.append(Problem("--streaming", f"{world} rank(s)", f"{path} holds the stream positions of "
                                f"{saved.get('world_size')} ranks, each reading its own documents: {world} ranks "
                                "would read other documents", f"resume with {saved.get('world_size')} ranks, {fix}"))
    if saved.get("shuffle_blocks") != shuffle_blocks:
        problems.append(Problem("--stream_shuffle_blocks", shuffle_blocks, f"{path} saved shuffle buffers of "
                                f"{saved.get('shuffle_blocks')} blocks", f"resume with --stream_shuffle_blocks "
                                f"{saved.get('shuffle_blocks')}, {fix}"))
    return problems


def identity_entry(data, world: int, shuffle_blocks: int) -> dict:
    """The checkpoint manifest's `data` entry of a stream (train.build.data_identity)."""
    return {**data.identity, "streamed": {"world_size": world, "shuffle_blocks": shuffle_blocks}}
