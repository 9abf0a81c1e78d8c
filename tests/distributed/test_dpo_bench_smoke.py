"""benchmarks/dpo_bench.py end to end on CPU: the trainer's preference path and TRL's DPOTrainer on the same pairs and
model, full fine-tuning (a stored reference on our side, TRL's precomputed one) and LoRA (the adapters off on both),
and the input it refuses."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import preloaded
from conftest import REPO

DPO_BENCH = REPO / "benchmarks" / "dpo_bench.py"


def run_dpo_bench(args: list[str], timeout: int = 600) -> subprocess.CompletedProcess:
    return preloaded.run([sys.executable, str(DPO_BENCH), *args], cwd=REPO, capture_output=True, text=True,
                         timeout=timeout, env=dict(os.environ, PYTHONPATH=str(REPO / "src")))


def test_dpo_bench_runs_both_sides_full_and_lora_on_the_same_pairs(tmp_path):
    """Tiny preset, 32 embedded pairs, sequences of at most 96 tokens, 2 blocks of 192 per optimizer step on our side
    and the pairs they hold on TRL's, 1 warm-up and 2 timed steps: every run reports its pairs, tokens and losses,
    the losses start at ln 2 where the policy is the reference, and the summary compares each mode's pair. Four
    trainings of a few steps, each a fresh process pair: this is the benchmark's own path up to the GPU."""
    pytest.importorskip("trl", reason="the TRL side needs trl (pip install .[bench])")
    out = run_dpo_bench(["--model", "tiny", "--seq_len", "96", "--micro_batch_size", "1", "--peer-micro-batch-size",
                         "1", "--global_batch_tokens", "384", "--steps", "2", "--warmup", "1", "--max_examples", "32",
                         "--timeout", "300", "--workdir", str(tmp_path / "work"), "--json", str(tmp_path / "r.jsonl"),
                         "--write-doc", str(tmp_path / "dpo.md"), "--log-dir", str(tmp_path / "logs")])
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    lines = [json.loads(line) for line in (tmp_path / "r.jsonl").read_text().splitlines()]
    runs = {line["job"]["name"]: line["result"] for line in lines if "job" in line}
    assert set(runs) == {"ours-full-mb1", "trl-full-mb1", "ours-lora-mb1", "trl-lora-mb1"}
    for name, r in runs.items():
        assert r["timed_steps"] == 2 and r["pairs_per_step"] >= 1 and r["tflops_per_gpu"] > 0, name
        assert r["losses"][0] == pytest.approx(0.6931, abs=1e-3), (name, r["losses"])  # policy = reference at step 0
        assert 0 < r["tokens_per_step_per_gpu"] <= 384, name
    assert runs["ours-full-mb1"]["reference"] == "stored" and runs["trl-lora-mb1"]["reference"] == "adapters off"
    assert runs["trl-full-mb1"]["padding_free"] is False  # TRL 1.16 pads
    summary = next(line["summary"] for line in lines if "summary" in line)
    assert set(summary) == {"full", "lora"} and summary["full"]["losses"]["steps"] == 3
    assert "| trl-lora-mb1 | TRL DPOTrainer | 1 x " in (tmp_path / "dpo.md").read_text()


@pytest.mark.parametrize("args, message", [
    (["--dataset", "missing.jsonl"], "--dataset missing.jsonl: no such file"),
    (["--global_batch_tokens", "1000"], "--global_batch_tokens 1000: not a multiple of micro-batch 1"),
])
def test_dpo_bench_names_bad_input(tmp_path, args, message):
    out = run_dpo_bench(["--model", "tiny", "--seq_len", "96", "--micro_batch_size", "1", "--workdir", str(tmp_path),
                         *args], timeout=120)
    assert out.returncode == 2 and message in out.stderr, out.stderr[-2000:]
