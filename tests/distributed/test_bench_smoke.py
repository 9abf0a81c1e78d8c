"""benchmarks/bench.py end to end on CPU: the trainer's own setup and train_step on the tiny preset (also profiled),
and the HF Trainer peer (the same code path as on GPUs). One invocation serves every test here."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import REPO


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    """Tiny preset, micro-batch 1 of 32 tokens, --global_batch_tokens 64 (2 micro-batches an optimizer step), one
    warm-up and 2 timed steps of the trainer's step with and without --document_mask (documents of ~8 tokens), and
    the HF Trainer peer without Liger; the engine runs also profiled. No GPU here: a stand-in nvidia-smi on PATH checks
    that every worker samples the clock over its timed steps."""
    tmp_path = tmp_path_factory.mktemp("bench")
    fake = tmp_path / "bin" / "nvidia-smi"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\necho '1650, 690.0, 0x0000000000000004'\nexec sleep 60\n")
    fake.chmod(0o755)
    env = dict(os.environ, PATH=f"{fake.parent}:{os.environ['PATH']}")
    out = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench.py"), "--model", "tiny", "--seq_len", "32",
                          "--micro_batch_size", "1", "--global_batch_tokens", "64", "--steps", "2", "--warmup", "1",
                          "--timeout", "240", "--variants", "default", "document_mask", "--document_length", "8",
                          "--compare-hf", "--hf-skip", "liger", "--write-doc", str(tmp_path / "perf.md"),
                          "--json", str(tmp_path / "results.jsonl"), "--profile", "--log-dir", str(tmp_path / "logs")],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    return tmp_path, {r["job"]["name"]: r for r in rows}


def test_bench_cpu_smoke_run(bench):
    """Every run is reported, clocks sampled; the documents change the loss and the FLOPs; --profile's phases."""
    tmp_path, rows = bench
    assert set(rows) == {"engine-default-mb1-ga2", "engine-document_mask-mb1-ga2", "hf-noliger-mb1-ga2"}
    doc = (tmp_path / "perf.md").read_text()
    assert "| engine-default-mb1-ga2 | 1 |" in doc and "| hf-noliger-mb1-ga2 | 1 |" in doc
    assert "| engine-document_mask-mb1-ga2 | 1 |" in doc
    assert doc.count("| 1,650 / 690 / 100% |") == 3
    # The same documents (~8 tokens each) in both engine runs: attention within them changes the loss.
    losses = {name: r["result"]["losses"] for name, r in rows.items() if r["job"]["kind"] == "engine"}
    assert len(losses) == 2 and losses["engine-default-mb1-ga2"] != losses["engine-document_mask-mb1-ga2"]
    # ...and their FLOPs count each document's attention square, not the block's 32 x 32.
    flops = {name: r["result"]["tflops_per_gpu"] / r["result"]["tokens_per_s_per_gpu"] for name, r in rows.items()
             if r["job"]["kind"] == "engine"}
    assert flops["engine-document_mask-mb1-ga2"] < flops["engine-default-mb1-ga2"] * (1 - 1e-3)
    # --profile runs the trainer's own step with each phase synchronised, then under torch.profiler.
    log = (tmp_path / "logs" / "engine-default-mb1-ga2.log").read_text()
    assert "phase timing" in log and "  backward   host" in log and "gpu idle: no GPU events" in log, log[-3000:]


def test_bench_times_whole_optimizer_steps_of_the_same_global_batch_on_both_sides(bench):
    """--global_batch_tokens 64 with micro-batch 1 of 32 tokens: both the trainer's step and HF Trainer's accumulate 2
    micro-batches per optimizer step, the timed steps are optimizer steps, and both report their host memory."""
    _, rows = bench
    for name in ("engine-default-mb1-ga2", "hf-noliger-mb1-ga2"):
        r = rows[name]["result"]
        assert (r["gradient_accumulation_steps"], r["tokens_per_optimizer_step"]) == (2, 64), name
        assert r["host_peak_gib"] > 0.1, name
    assert rows["hf-noliger-mb1-ga2"]["result"]["timed_steps"] == 2
    assert len(rows["engine-default-mb1-ga2"]["result"]["losses"]) == 3  # one loss per optimizer step, warm-up included
