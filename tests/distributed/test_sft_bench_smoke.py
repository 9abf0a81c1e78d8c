"""benchmarks/sft_bench.py end to end on CPU: the trainer's own fine-tuning path and TRL's SFTTrainer on the same chat
rows and model, full fine-tuning and LoRA, and the input it refuses."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import preloaded
from conftest import REPO

SFT_BENCH = REPO / "benchmarks" / "sft_bench.py"


def run_sft_bench(args: list[str], timeout: int = 600) -> subprocess.CompletedProcess:
    return preloaded.run([sys.executable, str(SFT_BENCH), *args], cwd=REPO, capture_output=True, text=True,
                         timeout=timeout, env=dict(os.environ, PYTHONPATH=str(REPO / "src")))


def test_sft_bench_runs_both_sides_full_and_lora_on_the_same_rows(tmp_path):
    """Tiny preset, 64 embedded chats, 2 blocks of 512 per optimizer step (micro-batch 1, accumulation 2), 1 warm-up
    and 2 timed steps: every run reports its example tokens and losses, both sides count the same tokens carrying
    loss in the whole data (the same assistant masks), and the summary compares each mode's pair."""
    pytest.importorskip("trl", reason="the TRL side needs trl (pip install .[bench])")
    out = run_sft_bench(["--model", "tiny", "--seq_len", "512", "--micro_batch_size", "1",
                         "--global_batch_tokens", "1024", "--steps", "2", "--warmup", "1", "--max_examples", "64",
                         "--timeout", "300", "--workdir", str(tmp_path / "work"), "--json", str(tmp_path / "r.jsonl"),
                         "--write-doc", str(tmp_path / "sft.md"), "--log-dir", str(tmp_path / "logs")])
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    lines = [json.loads(line) for line in (tmp_path / "r.jsonl").read_text().splitlines()]
    runs = {line["job"]["name"]: line["result"] for line in lines if "job" in line}
    assert set(runs) == {"ours-full-mb1-ga2", "trl-full-mb1-ga2", "ours-lora-mb1-ga2", "trl-lora-mb1-ga2"}
    for name, r in runs.items():
        assert r["timed_steps"] == 2 and r["blocks_per_step"] == 2, name
        assert len(r["losses"]) == 3 and all(5 < loss < 12 for loss in r["losses"]), (name, r["losses"])
        # Example tokens only: at most the blocks' 1024 positions, and the answers a part of them.
        assert 0 < r["loss_tokens_per_step_per_gpu"] < r["tokens_per_step_per_gpu"] <= 1024, name
        assert r["tokens_per_s_per_gpu"] > 0 and r["tflops_per_gpu"] > 0, name
    assert runs["ours-full-mb1-ga2"]["data_loss_tokens"] == runs["trl-full-mb1-ga2"]["data_loss_tokens"]
    # The same model on both sides; LoRA's adapters are not counted in its FLOPs.
    assert len({r["num_params"] for r in runs.values()}) == 1
    summary = next(line["summary"] for line in lines if "summary" in line)
    assert set(summary) == {"full", "lora"} and summary["full"]["losses"]["steps"] == 3
    # The kernels each side ran, as they resolved them: on CPU, SDPA with transformers' mask and no Liger on both.
    assert summary["full"]["kernels"] == {"ours": {"attention": "sdpa", "liger": "off"},
                                          "peer": {"attention": "sdpa", "liger": False}}
    doc = (tmp_path / "sft.md").read_text()
    assert "| trl-lora-mb1-ga2 | TRL SFTTrainer | 1 x 2 |" in doc and "lora, best micro-batch each" in doc
    assert (tmp_path / "logs" / "trl-full-mb1-ga2.log").exists()


@pytest.mark.parametrize("args, message", [
    (["--dataset", "missing.jsonl"], "--dataset missing.jsonl: no such file"),
    (["--global_batch_tokens", "1000"], "--global_batch_tokens 1000: not a multiple of micro-batch 1"),
    (["--model", "no-such-model"], "--model no-such-model: neither a preset"),
])
def test_sft_bench_names_bad_input(tmp_path, args, message):
    out = run_sft_bench(["--model", "tiny", "--seq_len", "256", "--micro_batch_size", "1", "--workdir",
                         str(tmp_path), *args], timeout=120)
    assert out.returncode == 2 and message in out.stderr, out.stderr[-2000:]


def test_sft_bench_refuses_rows_that_are_not_chats(tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"text": "a document"}) + "\n")
    out = run_sft_bench(["--model", "tiny", "--dataset", str(rows), "--workdir", str(tmp_path / "w")], timeout=120)
    assert out.returncode == 2 and "line 1 has no `messages`" in out.stderr, out.stderr[-2000:]
