"""benchmarks/vlm_bench.py end to end on CPU: the trainer's vision-language path and TRL's SFTTrainer for
vision-language models on the same image chats and model directory, with LoRA."""

from __future__ import annotations

import json
import os
import sys

import pytest
import preloaded
from conftest import REPO

VLM_BENCH = REPO / "benchmarks" / "vlm_bench.py"


def test_vlm_bench_runs_both_sides_with_lora_on_the_same_image_chats(tmp_path):
    """tiny-vl written as a model directory with its processor, 32 image chats (some without an image), blocks of 256
    tokens (ours, micro-batch 1) against one padded example per micro-batch (TRL), 1 warm-up and 2 timed steps, LoRA
    (the full mode takes the same path with every language-model weight trained: the unit tests build both). Every run reports its example tokens (image tokens
    among them), padding share, images and the tower's FLOPs beside the language model's; both sides resize the images
    alike (the same image tokens over the whole data), train the same language model and freeze the same tower."""
    pytest.importorskip("trl", reason="the TRL side needs trl (pip install .[bench])")
    from packaging.version import Version
    from transformers import __version__ as transformers_version

    out = preloaded.run([sys.executable, str(VLM_BENCH), "--model", "tiny-vl", "--seq_len", "256",
                         "--micro_batch_size", "1", "--peer-micro-batch-size", "1", "--steps", "2", "--warmup", "1",
                         "--max_examples", "32", "--modes", "lora", "--timeout", "300",
                         "--workdir", str(tmp_path / "work"), "--json", str(tmp_path / "r.jsonl"),
                         "--write-doc", str(tmp_path / "vlm.md")],
                        cwd=REPO, capture_output=True, text=True, timeout=600,
                        env=dict(os.environ, PYTHONPATH=str(REPO / "src")))
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    assert "32 rows (29 with an image, 3 without)" in out.stdout, out.stdout[:2000]  # seeded: the same rows each time
    lines = [json.loads(line) for line in (tmp_path / "r.jsonl").read_text().splitlines()]
    runs = {line["job"]["name"]: line["result"] for line in lines if "job" in line}
    assert set(runs) == {"ours-lora-mb1-ga1", "trl-lora-mb1-ga1"}
    for name, r in runs.items():
        assert r["timed_steps"] == 2 and len(r["losses"]) == 3, name
        assert all(8 < loss < 10 for loss in r["losses"]), (name, r["losses"])  # random init: about ln(vocabulary)
        # Example tokens only, image tokens among them; the positions hold them and the padding.
        assert 0 < r["loss_tokens_per_step_per_gpu"] < r["tokens_per_step_per_gpu"], name
        assert r["image_tokens_per_step_per_gpu"] < r["tokens_per_step_per_gpu"] <= r["positions_per_step_per_gpu"]
        assert r["padding_share"] == pytest.approx(1 - r["tokens_per_step_per_gpu"] / r["positions_per_step_per_gpu"])
        assert r["tokens_per_s_per_gpu"] > 0 and r["tflops_per_gpu"] > 0, name
        if r["images_per_step_per_gpu"]:  # the frozen tower's and the projector's FLOPs on top of the language model's
            assert r["extra_tflops_per_gpu"] > 0, name
    ours, peer = runs["ours-lora-mb1-ga1"], runs["trl-lora-mb1-ga1"]
    assert ours["positions_per_step_per_gpu"] == 256 and ours["padding_share"] > 0  # one example and padding a block
    assert peer["padding_share"] == 0  # one example per micro-batch: no padding
    # The same language model counted on both sides (its parameters for the FLOPs), the tower frozen on ours.
    assert len({r["num_params"] for r in runs.values()}) == 1 and ours["frozen"] == ["vision_tower"]
    summary = next(line["summary"] for line in lines if "summary" in line)
    assert set(summary) == {"lora"} and summary["lora"]["losses"]["steps"] == 3
    full = summary["lora"]
    assert full["data_image_tokens"]["ours"] == full["data_image_tokens"]["peer"] > 0
    assert full["kernels"] == {"ours": {"attention": "sdpa", "liger": "off"},
                               "peer": {"attention": "sdpa", "liger": False}}
    # TRL's assistant-only loss for images: from transformers 5.18 on; below it, refused and the loss on every token.
    supported = Version(transformers_version) >= Version("5.18.0.dev0")
    assert full["peer_assistant_only_loss"] is supported
    assert supported or "Assistant-only loss for vision datasets requires" in full["peer_refused"]
    doc = (tmp_path / "vlm.md").read_text()
    assert "| trl-lora-mb1-ga1 | TRL SFTTrainer | 1 x 1 |" in doc and "lora, best micro-batch each" in doc
