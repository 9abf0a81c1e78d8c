"""--streaming (model_utils.data.streaming): local JSONL and Parquet files read with datasets' streaming path, the
blocks each rank reads, the held-out validation documents, the state that resumes a stream exactly, and the
refusals."""

from __future__ import annotations

import pickle
from dataclasses import dataclass

import numpy as np
import pytest
from inputs import jsonl

from model_utils.config.checks import validate_args
from model_utils.config.settings import DataConfig, TrainConfig
from model_utils.data.blocks import DataPosition, PackedTokens
from model_utils.data.errors import DataError
from model_utils.data.pipeline import prepare_data
from model_utils.data.sources import resolve_source
from model_utils.data.streaming import held_out, stream_resume_problems
from model_utils.data.tokenizer import load_tokenizer

SEQ_LEN = 16


@dataclass
class OneProcessRanks:
    """The rank and world size a stream is split by, in this one process (each rank's stream is opened in turn;
    broadcasting from rank 0 is the identity)."""

    rank: int
    world_size: int
    is_main: bool = True

    @property
    def data_rank(self) -> int:  # no sequence parallelism: each rank reads its own share
        return self.rank

    @property
    def data_world(self) -> int:
        return self.world_size

    def broadcast_object(self, obj):
        return obj


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)


def documents(shard: int, count: int) -> list[dict]:
    return [{"text": f"Shard {shard}, document {i}: " + " ".join(f"w{(shard * 31 + i * k) % 89}"
                                                                  for k in range(3 + (i * 7) % 23))}
            for i in range(count)]


@pytest.fixture
def shards(tmp_path):
    """Four JSONL shards of 12 documents each."""
    folder = tmp_path / "shards"
    folder.mkdir()
    for s in range(4):
        jsonl(folder / f"part-{s}.jsonl", documents(s, 12))
    return folder


def open_rank(tokenizer, dataset, rank=0, world=1, **flags):
    cfg = DataConfig(dataset=str(dataset), streaming=True, **{"stream_shuffle_blocks": 0, **flags})
    return prepare_data(cfg, tokenizer, SEQ_LEN, OneProcessRanks(rank, world), seed=7)


def read(data, world, steps, rank=0, micro=2, position=None):
    order, position = data.order(world, micro), position or DataPosition()
    blocks = []
    for _ in range(steps):
        blocks.append(data.train.batch(order.rank_indices(position, rank)))
        position = order.advance(position)
    return np.concatenate(blocks), position


def document_tokens(tokenizer, rows):
    """Every document's ids and its EOS, back to back: the token cache's rule (data.tokens.tokenize_split)."""
    ids = tokenizer([r["text"] for r in rows], add_special_tokens=False)["input_ids"]
    return np.concatenate([np.asarray(x + [tokenizer.eos_token_id]) for x in ids if x])


def test_blocks_are_the_token_caches_blocks_of_the_training_documents(tokenizer, shards):
    """One rank, no shuffle: block i is PackedTokens' block i of the documents in order, an EOS after each, without
    the documents held out by digest; the validation blocks are those of the held-out documents."""
    data = open_rank(tokenizer, shards, validation_fraction=0.25)
    rows = [row for s in range(4) for row in documents(s, 12)]
    kept = [r for r in rows if not held_out(r, "text", 0.25)]
    assert 0 < len(kept) < len(rows)  # the held-out rule holds some out, not all
    packed = PackedTokens(document_tokens(tokenizer, kept), SEQ_LEN)
    got, _ = read(data, 1, 10)
    assert np.array_equal(got, packed.batch(range(20)))
    validation = PackedTokens(document_tokens(tokenizer, [r for r in rows if r not in kept]), SEQ_LEN)
    assert data.val.num_blocks == validation.num_blocks > 0
    assert np.array_equal(data.val.batch(data.val_ids), validation.batch(range(validation.num_blocks)))


def test_each_rank_reads_its_own_documents(tokenizer, shards, tmp_path):
    """Four shards on two ranks (whole shards each) and one file on two ranks (every other document): the ranks'
    first epochs hold every training document once between them."""
    one_file = jsonl(tmp_path / "one.jsonl", documents(9, 40))
    for dataset, rule in ((shards, "whole shards"), (one_file, "every one of its documents in turn")):
        seen = []
        for rank in (0, 1):
            data = open_rank(tokenizer, dataset, rank=rank, world=2, validation_fraction=0.0)
            assert rule in data.description
            seen += [d["text"] for d in data.train.open_documents()]
        everything = [r["text"] for r in (documents(9, 40) if dataset == one_file else
                                          [row for s in range(4) for row in documents(s, 12)])]
        assert sorted(seen) == sorted(everything)


@pytest.mark.parametrize("stop_after", [1, 40, 50])
def test_a_saved_stream_continues_exactly(tokenizer, tmp_path, stop_after):
    """Parquet, two ranks, a shuffle buffer: a rank's reader saved after `stop_after` steps (pickled, as a checkpoint
    holds it) and restored in a fresh reader reads the blocks the uninterrupted reader reads, in its order. Step 1
    saves a place inside the rank's shard, step 40 the seam where the rank starts its share again (the next epoch,
    tokens of the last one still to pack), step 50 a place in that next epoch."""
    import pyarrow
    import pyarrow.parquet

    folder = tmp_path / "parquet"
    folder.mkdir()
    for s in range(2):
        pyarrow.parquet.write_table(pyarrow.Table.from_pylist(documents(s, 150)), folder / f"part-{s}.parquet")
    flags, micro = {"stream_shuffle_blocks": 4, "validation_fraction": 0.1}, 8
    whole, _ = read(open_rank(tokenizer, folder, 1, 2, **flags), 2, 60, rank=1, micro=micro)
    first = open_rank(tokenizer, folder, 1, 2, **flags)
    before, position = read(first, 2, stop_after, rank=1, micro=micro)
    saved = pickle.loads(pickle.dumps(first.train.state_dict()))
    second = open_rank(tokenizer, folder, 1, 2, **flags)
    second.train.load_state_dict(saved)
    after, _ = read(second, 2, 60 - stop_after, rank=1, micro=micro, position=position)
    assert np.array_equal(np.concatenate([before, after]), whole)
    assert (saved["epoch"], saved["stream"] is None) == {1: (0, False), 40: (1, True), 50: (1, False)}[stop_after]


def test_the_shuffle_buffer_reorders_the_blocks_by_the_seed(tokenizer, shards):
    plain, _ = read(open_rank(tokenizer, shards), 1, 8)
    shuffled, _ = read(open_rank(tokenizer, shards, stream_shuffle_blocks=6), 1, 8)
    assert not np.array_equal(plain, shuffled)
    # A buffer only moves blocks within its reach: every block read is one of the stream's first 16 + 6.
    later, _ = read(open_rank(tokenizer, shards), 1, 11)
    assert {b.tobytes() for b in shuffled} <= {b.tobytes() for b in later}


def test_a_step_that_asks_for_other_blocks_than_the_streams_next_stops(tokenizer, shards):
    data = open_rank(tokenizer, shards)
    with pytest.raises(RuntimeError, match="the data position and the stream's state disagree"):
        data.train.batch(np.array([4, 5]))


def test_a_rank_with_no_documents_is_a_problem_naming_the_dataset(tokenizer, tmp_path):
    single = jsonl(tmp_path / "one.jsonl", documents(0, 1))
    data = open_rank(tokenizer, single, rank=1, world=2, validation_fraction=0.0)
    with pytest.raises(DataError) as caught:
        read(data, 2, 1, rank=1)
    assert caught.value.problem.setting == "--dataset" and "holds no training tokens" in caught.value.problem.message


def test_a_missing_column_is_a_problem_naming_the_column(tokenizer, tmp_path):
    rows = jsonl(tmp_path / "body.jsonl", [{"body": "words"}] * 20)
    with pytest.raises(DataError) as caught:
        read(open_rank(tokenizer, rows, validation_fraction=0.0), 1, 1)
    assert caught.value.problem.setting == "--text_column" and "body" in caught.value.problem.message


def test_data_read_without_downloading_is_not_streamed(tmp_path):
    np.save(tmp_path / "tokens.npy", np.arange(100, dtype=np.uint16))
    with pytest.raises(DataError) as caught:
        resolve_source(DataConfig(dataset=str(tmp_path / "tokens.npy"), streaming=True))
    assert caught.value.problem.setting == "--streaming" and "drop --streaming" in caught.value.problem.fix


def test_streaming_refuses_the_cache_only_flags():
    for flag, value in (("max_documents", 10), ("dummy_data", 8)):
        problems = validate_args(TrainConfig.from_flags(streaming=True, **{flag: value}))
        assert any(p.setting == f"--{flag}" and "--streaming" in p.fix for p in problems), problems


def test_a_stream_resumes_only_with_its_ranks_buffer_and_mode(tmp_path):
    path = tmp_path / "step-00000004"
    streamed = {"data": {"dataset": "d", "fingerprint": "f", "streamed": {"world_size": 2, "shuffle_blocks": 8}}}
    cached = {"data": {"dataset": "d", "tokens": 100, "fingerprint": "f"}}
    assert stream_resume_problems(streamed, path, True, 8, 2) == []
    assert stream_resume_problems(cached, path, False, 8, 1) == []
    other_world = stream_resume_problems(streamed, path, True, 8, 1)
    assert [p.setting for p in other_world] == ["--streaming"] and "resume with 2 ranks" in other_world[0].fix
    other_buffer = stream_resume_problems(streamed, path, True, 16, 2)
    assert [p.setting for p in other_buffer] == ["--stream_shuffle_blocks"] and "8" in other_buffer[0].fix
    assert "resume with --streaming" in stream_resume_problems(streamed, path, False, 8, 2)[0].fix
    assert "resume without --streaming" in stream_resume_problems(cached, path, True, 8, 2)[0].fix


def test_the_preflight_samples_the_stream_and_leaves_the_epochs_unknown(shards, tmp_path, monkeypatch, capsys):
    import train_deepspeed

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.chdir(tmp_path)
    code = train_deepspeed.main(["--preflight", "--streaming", "--dataset", str(shards), "--seq_len", "64",
                                 "--checkpoint_dir", str(tmp_path / "ckpt")])
    out = capsys.readouterr().out
    assert code == 0, out
    assert f"data: {shards} streams (--streaming): column 'text' present; its first 48 documents" in out
    assert "(epochs unknown: the data streams)" in out


def test_a_stream_of_one_local_file_takes_its_columns_from_the_file(tmp_path):
    """A streamed JSONL file's columns come from its first record, as for the file read whole: datasets' loader would
    take the file's path for a hub name (and the hub's --dataset_config_name, which local files do not have)."""
    from model_utils.data.sft.formats import PRETRAINING, resolve_data_format

    jsonl(tmp_path / "docs.jsonl", documents(0, 4))
    cfg = DataConfig(dataset=str(tmp_path / "docs.jsonl"), streaming=True, dataset_config_name="sample-10BT")
    assert resolve_data_format(cfg, resolve_source(cfg)) == PRETRAINING
