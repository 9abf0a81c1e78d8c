"""Waiting on another process's data preparation through its files, and weighted mixtures of datasets."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from model_utils.config.settings import DataConfig
from model_utils.core.problems import Problem
from model_utils.data.blocks import BlockOrder, DataPosition
from model_utils.data.errors import DataError
from model_utils.data.mixture import share_counts
from model_utils.data.pipeline import prepare_data
from model_utils.data.progress import PreparationFailed, Progress, record_failure, wait_for_preparer, write_json_atomic
from model_utils.data.sources import parse_mixture, resolve_source
from model_utils.data.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)


class OneProcess:
    rank = local_rank = 0
    world_size = 1

    def broadcast_object(self, obj):
        return obj


def files(tmp_path: Path):
    return tmp_path / "meta.json", tmp_path / "progress.json", tmp_path / "failed.json"


def test_a_waiter_raises_the_preparers_recorded_problem(tmp_path):
    finished, progress, failure = files(tmp_path)
    record_failure(failure, Problem("--text_column", "body", "no such column", "pass --text_column text"), "claim-1")
    with pytest.raises(PreparationFailed) as caught:
        wait_for_preparer(finished, progress, failure, "claim-1", "the data", stale_seconds=60, poll_seconds=0.01)
    assert caught.value.problem.setting == "--text_column" and "no such column" in caught.value.problem.message
    assert not caught.value.lost  # the preparer is alive and stops with the same problem


def test_a_failure_of_another_attempt_is_not_this_ones(tmp_path):
    """A failure record left by an earlier run (another claim) is ignored: here the data are finished."""
    finished, progress, failure = files(tmp_path)
    record_failure(failure, Problem("--dataset", "x", "old problem", "old fix"), "an-earlier-claim")
    finished.write_text("{}")
    wait_for_preparer(finished, progress, failure, "claim-2", "the data", stale_seconds=60, poll_seconds=0.01)


def test_a_preparer_that_died_is_reported_with_its_progress(tmp_path):
    """The progress file of a process on this host that no longer exists: the waiter stops at once, naming the
    file, the process and how far it got."""
    finished, progress, failure = files(tmp_path)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    import socket

    write_json_atomic(progress, {"claim": "c", "host": socket.gethostname(), "pid": int(dead.stdout), "beat": 3,
                                 "documents": 1234, "tokens": 56789, "tokens_per_second": 1000.0})
    with pytest.raises(PreparationFailed) as caught:
        wait_for_preparer(finished, progress, failure, "c", "the token cache", stale_seconds=600, poll_seconds=0.01)
    problem = caught.value.problem
    assert problem.value == str(progress) and "exited without finishing" in problem.message
    assert "1,234 documents" in problem.message and "run again" in problem.fix


def test_a_preparer_whose_heartbeat_stops_is_stale(tmp_path):
    finished, progress, failure = files(tmp_path)
    write_json_atomic(progress, {"claim": "c", "host": "another-node", "pid": 1, "beat": 7, "documents": 10,
                                 "tokens": 100})
    with pytest.raises(PreparationFailed) as caught:
        wait_for_preparer(finished, progress, failure, "c", "the data", stale_seconds=0.05, poll_seconds=0.01)
    assert caught.value.problem.setting == "--data_stale_minutes" and "another-node" in caught.value.problem.message
    assert caught.value.lost


def test_progress_in_a_log_is_plain_lines_and_the_file_counts(tmp_path):
    log = io.StringIO()  # not a terminal: periodic lines, no bar
    with Progress(tmp_path / "progress.json", "prepare", total_units=100, claim="c", stream=log,
                  line_seconds=0.0) as progress:
        progress.update(10, 1000, 25)
        progress.update(10, 1000, 25)
        state = json.loads((tmp_path / "progress.json").read_text())
    final = json.loads((tmp_path / "progress.json").read_text())
    assert "\r" not in log.getvalue() and "20 documents" in log.getvalue() and "50.0% of the input" in log.getvalue()
    assert "ETA" in log.getvalue() and state["claim"] == "c"
    assert final["status"] == "done" and final["tokens"] == 2000 and final["fraction"] == 0.5


def test_the_token_cache_is_built_beside_its_progress_file(tmp_path, tokenizer):
    """Rank 0 tokenizes into the cache beside a progress file that counts every document; a later start finds the
    finished entry and opens the same blocks."""
    data = tmp_path / "a.jsonl"
    data.write_text("".join(json.dumps({"text": f"document {i} " * 20}) + "\n" for i in range(200)))
    cfg = DataConfig(dataset=str(data), data_cache_dir=str(tmp_path / "cache"))
    first = prepare_data(cfg, tokenizer, 32, OneProcess(), log=lambda *_: None)
    entry = next(p for p in (tmp_path / "cache" / "packed").iterdir() if p.is_dir())  # beside its .json files
    progress = json.loads(entry.with_name(f"{entry.name}.progress.json").read_text())
    assert progress["status"] == "done" and progress["documents"] == 200 and progress["fraction"] == 1.0
    again = prepare_data(cfg, tokenizer, 32, OneProcess(), log=lambda *_: None, seed=5)
    np.testing.assert_array_equal(first.train_ids, again.train_ids)


def test_mixture_specs(tmp_path):
    (tmp_path / "a.jsonl").write_text("")
    (tmp_path / "b").mkdir()
    assert parse_mixture(str(tmp_path / "a.jsonl")) is None  # an existing path is one dataset
    assert parse_mixture("org/name") is None
    assert parse_mixture(f"{tmp_path / 'a.jsonl'}:0.7,{tmp_path / 'b'}:0.3") == [(str(tmp_path / "a.jsonl"), 0.7),
                                                                                 (str(tmp_path / "b"), 0.3)]
    spec = tmp_path / "mix.json"
    spec.write_text(json.dumps({"mixture": [{"dataset": "a.jsonl", "weight": 2}, {"dataset": "b", "weight": 1}]}))
    assert parse_mixture(str(spec)) == [(str(tmp_path / "a.jsonl"), 2.0), (str(tmp_path / "b"), 1.0)]
    for bad, words in (("a.jsonl:0.7,b", "has no weight"), ("a.jsonl:0,b:1", "weight of a.jsonl is 0.0"),
                       ("a:1,a:2", "twice")):
        with pytest.raises(DataError) as caught:
            parse_mixture(bad)
        assert words in caught.value.problem.message
    assert share_counts([0.7, 0.3], 101) == [71, 30] and sum(share_counts([1, 1, 1], 100)) == 100


def test_a_mixture_realises_its_weights_deterministically(tmp_path, tokenizer):
    """Two parts of very different sizes at 50/50: the small one repeats, the large one is subsampled; the block
    list is the same for a seed and differs for another; a run resumed at a position reads what an uninterrupted
    one reads; validation comes from both parts; the data line states the shares."""
    small, large = tmp_path / "small.jsonl", tmp_path / "large.jsonl"
    small.write_text("".join(json.dumps({"text": f"small part {i} " * 30}) + "\n" for i in range(20)))
    large.write_text("".join(json.dumps({"text": f"large part {i} " * 30}) + "\n" for i in range(200)))
    spec = f"{small}:0.5,{large}:0.5"
    cfg = DataConfig(dataset=spec, data_cache_dir=str(tmp_path / "cache"), validation_fraction=0.05)
    assert resolve_source(cfg).kind == "mixture"
    data = prepare_data(cfg, tokenizer, 32, OneProcess(), log=lambda *_: None, seed=5)
    parts = data.train.parts
    from_small = np.sum(data.train_ids < data.train.offsets[1])
    assert from_small == len(data.train_ids) // 2 and from_small > parts[0].num_blocks  # repeated to its share
    assert "small.jsonl 50.0%" in data.description and "large.jsonl 50.0%" in data.description
    assert (data.val_ids < data.val.offsets[1]).any() and (data.val_ids >= data.val.offsets[1]).any()
    again = prepare_data(cfg, tokenizer, 32, OneProcess(), log=lambda *_: None, seed=5)
    np.testing.assert_array_equal(data.train_ids, again.train_ids)
    other_seed = prepare_data(cfg, tokenizer, 32, OneProcess(), log=lambda *_: None, seed=6)
    assert not np.array_equal(np.sort(data.train_ids), np.sort(other_seed.train_ids))
    from model_utils.data.tokens import token_fingerprint

    assert token_fingerprint(data.train.tokens) != token_fingerprint(other_seed.train.tokens)

    order = BlockOrder(data.train_ids, 5, world_size=2, micro_batch=2)
    position, read = DataPosition(), []
    for _ in range(12):
        read.append([data.train.batch(order.rank_indices(position, r)) for r in (0, 1)])
        position = order.advance(position)
    resumed = BlockOrder(again.train_ids, 5, world_size=2, micro_batch=2)
    at = DataPosition.from_state_dict(json.loads(json.dumps(DataPosition(0, 6 * 4).state_dict())))
    for step in range(6, 12):
        for r in (0, 1):
            np.testing.assert_array_equal(again.train.batch(resumed.rank_indices(at, r)), read[step][r])
        at = resumed.advance(at)
