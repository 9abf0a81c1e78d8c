"""Training on prepared data (2 CPU ranks, real DeepSpeed): the same blocks, in the same order, as training on the raw
files; the preflight reads the manifest; a mixture trains and states its shares."""

from __future__ import annotations

import json
import os
import sys

import pytest
import preloaded
from conftest import FAST_ARGS, REPO, TRAINER, assert_ok, run_trainer

from model_utils.config.settings import DataConfig
from model_utils.data.prepare import prepare

ARGS = [*FAST_ARGS, "--max_steps", "3", "--checkpoint_freq", "3", "--no-export", "--seed", "11", "--trace_data"]


@pytest.fixture(scope="module")
def prepared_corpus(session_cache, tmp_path_factory):
    """The embedded corpus (the raw runs' default data), prepared in several shards by two processes."""
    output = tmp_path_factory.mktemp("prepared") / "corpus"
    prepare(DataConfig(), None, output, num_proc=2, shard_mb=0.2, log=lambda *_: None,
            stream=open(os.devnull, "w"))
    return output


def traces(checkpoint_dir) -> dict:
    return {p.name: p.read_text() for p in sorted((checkpoint_dir / "data_trace").glob("rank-*.jsonl"))}


def test_prepared_data_trains_on_the_blocks_of_the_raw_files(prepared_corpus, session_cache, tmp_path):
    raw = run_trainer(tmp_path / "raw", ARGS)
    prepared = run_trainer(tmp_path / "prepared", [*ARGS, "--dataset", str(prepared_corpus)])
    assert_ok(raw)
    assert_ok(prepared)
    assert f"data: prepared {prepared_corpus}" in prepared.output and "shards" in prepared.output
    assert traces(tmp_path / "raw") == traces(tmp_path / "prepared") and len(traces(tmp_path / "raw")) == 2
    # The data identity digests the training tokens: the same stream, so a run may resume across the two.
    raw_data = json.loads((tmp_path / "raw" / "step-00000003" / "manifest.json").read_text())["data"]
    prepared_data = json.loads((tmp_path / "prepared" / "step-00000003" / "manifest.json").read_text())["data"]
    assert raw_data["fingerprint"] == prepared_data["fingerprint"] and raw_data["tokens"] == prepared_data["tokens"]
    assert [r["loss"] for r in raw.train_records()] == pytest.approx([r["loss"] for r in prepared.train_records()])

    preflight = preloaded.run([sys.executable, str(TRAINER), "--preflight", *ARGS, "--dataset", str(prepared_corpus),
                               "--checkpoint_dir", str(tmp_path / "preflight")], cwd=REPO, capture_output=True,
                              text=True, timeout=300, env=dict(os.environ, WORLD_SIZE="1"))
    assert preflight.returncode == 0, preflight.stdout + preflight.stderr
    assert f"data: prepared {prepared_corpus}" in preflight.stdout


def test_a_mixture_trains_and_states_its_shares(prepared_corpus, session_cache, tmp_path):
    extra = tmp_path / "extra.jsonl"
    extra.write_text("".join(json.dumps({"text": f"An extra document number {i}. " * 40}) + "\n" for i in range(100)))
    spec = f"{prepared_corpus}:0.8,{extra}:0.2"
    run = run_trainer(tmp_path / "mixed", [*ARGS, "--dataset", spec, "--data_cache_dir", str(tmp_path / "cache")])
    assert_ok(run)
    assert "data: mixture of 2: corpus 80.0%" in run.output and "extra.jsonl 20.0%" in run.output
