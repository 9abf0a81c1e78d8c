"""benchmarks/bench.py end to end on CPU: the trainer's own setup and train_step on the tiny preset (also profiled),
and the HF Trainer peer (the same code path as on GPUs)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import REPO


def test_bench_cpu_smoke_run(tmp_path):
    """The benchmark end to end on CPU: tiny preset, the trainer's setup/compute_loss, one timed step, and the HF
    Trainer peer without Liger. No GPU here: a stand-in nvidia-smi on PATH checks that both workers sample the clock
    over their timed steps."""
    fake = tmp_path / "bin" / "nvidia-smi"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\necho '1650, 690.0, 0x0000000000000004'\nexec sleep 60\n")
    fake.chmod(0o755)
    env = dict(os.environ, PATH=f"{fake.parent}:{os.environ['PATH']}")
    out = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench.py"), "--model", "tiny", "--seq_len", "32",
                          "--micro_batch_size", "1", "--steps", "2", "--warmup", "1", "--timeout", "240",
                          "--variants", "default", "document_mask", "--document_length", "8",
                          "--compare-hf", "--hf-skip", "liger", "--write-doc", str(tmp_path / "perf.md"),
                          "--json", str(tmp_path / "results.jsonl"), "--profile", "--log-dir", str(tmp_path / "logs")],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    doc = (tmp_path / "perf.md").read_text()
    assert "| engine-default-mb1 | 1 |" in doc and "| hf-noliger-mb1 | 1 |" in doc
    assert "| engine-document_mask-mb1 | 1 |" in doc
    assert doc.count("| 1,650 / 690 / 100% |") == 3
    # The same documents (~8 tokens each) in both engine runs: attention within them changes the loss.
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    losses = {r["job"]["name"]: r["result"]["losses"] for r in rows if r["job"]["kind"] == "engine"}
    assert len(losses) == 2 and losses["engine-default-mb1"] != losses["engine-document_mask-mb1"]
    # ...and their FLOPs count each document's attention square, not the block's 32 x 32.
    flops = {r["job"]["name"]: r["result"]["tflops_per_gpu"] / r["result"]["tokens_per_s_per_gpu"] for r in rows
             if r["job"]["kind"] == "engine"}
    assert flops["engine-document_mask-mb1"] < flops["engine-default-mb1"] * (1 - 1e-3)
    # --profile runs the trainer's own step with each phase synchronised, then under torch.profiler.
    log = (tmp_path / "logs" / "engine-default-mb1.log").read_text()
    assert "phase timing" in log and "  backward   host" in log and "gpu idle: no GPU events" in log, log[-3000:]


def test_bench_times_whole_optimizer_steps_of_the_same_global_batch_on_both_sides(tmp_path):
    """--global_batch_tokens 64 with micro-batch 1 of 32 tokens: both the trainer's step and HF Trainer's accumulate 2
    micro-batches per optimizer step, the timed steps are optimizer steps, and both report their host memory."""
    out = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench.py"), "--model", "tiny", "--seq_len", "32",
                          "--micro_batch_size", "1", "--global_batch_tokens", "64", "--steps", "2", "--warmup", "1",
                          "--timeout", "240", "--variants", "default", "--compare-hf", "--hf-skip", "liger",
                          "--json", str(tmp_path / "results.jsonl")],
                         cwd=REPO, capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = {json.loads(line)["job"]["name"]: json.loads(line)["result"]
            for line in (tmp_path / "results.jsonl").read_text().splitlines()}
    assert set(rows) == {"engine-default-mb1-ga2", "hf-noliger-mb1-ga2"}
    for r in rows.values():
        assert (r["gradient_accumulation_steps"], r["tokens_per_optimizer_step"]) == (2, 64)
        assert r["host_peak_gib"] > 0.1
    assert rows["hf-noliger-mb1-ga2"]["timed_steps"] == 2
    assert len(rows["engine-default-mb1-ga2"]["losses"]) == 3  # one loss per optimizer step, warm-up included
