"""--streaming in real runs: 2 gloo ranks stream local JSONL shards; a run killed after a checkpoint and resumed
continues as the uninterrupted run does, bit for bit, across the seam where each rank starts its share again; a
resume on another number of ranks is refused before any work."""

from __future__ import annotations

import json
import re

import pytest
from conftest import FAST_ARGS, assert_ok, kill_after_checkpoint_then_resume, run_trainer
from inputs import jsonl


def stream_args(shards) -> list[str]:
    return [*FAST_ARGS, "--streaming", "--dataset", str(shards), "--stream_shuffle_blocks", "6", "--max_steps", "8",
            "--checkpoint_freq", "4", "--no-export", "--seed", "5", "--trace_data", "--eval_interval", "4",
            "--validation_fraction", "0.2"]


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """Four shards (two per rank) of short documents: each rank's share is read through within the run's first
    steps, so the checkpoint falls after a rank has started its share again."""
    folder = tmp_path_factory.mktemp("stream") / "shards"
    folder.mkdir()
    for s in range(4):
        jsonl(folder / f"part-{s}.jsonl", [{"text": f"Shard {s} document {i}: " + " ".join(
            f"w{(s * 13 + i * k) % 71}" for k in range(4 + (i * 5) % 17))} for i in range(8)])
    return folder


@pytest.fixture(scope="module")
def uninterrupted(shards, tmp_path_factory):
    run = run_trainer(tmp_path_factory.mktemp("stream-baseline") / "ckpt", stream_args(shards))
    assert_ok(run)
    return run


def test_a_killed_streamed_run_resumes_exactly(shards, uninterrupted, tmp_path):
    assert "streams (--streaming, 4 shard(s)): each of 2 rank(s) reads its own documents (whole shards)" in \
        uninterrupted.output
    assert "(epochs unknown: the data streams)" in uninterrupted.output
    resumed = kill_after_checkpoint_then_resume(tmp_path / "ckpt", stream_args(shards), 4)
    assert re.search(r"resume: the stream continues at epoch [1-9]", resumed.output)  # past each rank's seam
    want, got = uninterrupted.losses_by_step(), resumed.losses_by_step()
    assert sorted(want) == list(range(1, 9))
    assert [got[step] for step in range(5, 9)] == [want[step] for step in range(5, 9)]
    evaluations = [r["eval_loss"] for r in uninterrupted.metrics() if "eval_loss" in r]
    assert evaluations and [r["eval_loss"] for r in resumed.metrics() if "eval_loss" in r][-1] == evaluations[-1]
    for rank in ("rank-00000.jsonl", "rank-00001.jsonl"):  # the same block names, step by step
        traces = [{r["step"]: r["blocks"] for r in map(json.loads, (run.checkpoint_dir / "data_trace" / rank)
                                                        .read_text().splitlines())} for run in (uninterrupted, resumed)]
        assert traces[0] == traces[1]


def test_a_stream_does_not_resume_on_another_number_of_ranks(shards, uninterrupted, tmp_path):
    import shutil

    ckpt = shutil.copytree(uninterrupted.checkpoint_dir, tmp_path / "ckpt")
    run = run_trainer(ckpt, [*stream_args(shards), "--max_steps", "12"], nproc=1)
    assert run.returncode == 2, run.output
    assert "--streaming = 1 rank(s)" in run.output and "holds the stream positions of 2 ranks" in run.output
    assert "fix: resume with 2 ranks" in run.output and "Traceback" not in run.output
