"""The preference journey on CPU, offline, as docs/PREFERENCE.md runs it: pretrain the tiny preset, fine-tune its export
on the embedded chats, tune that on the embedded pairs with DPO, export, generate."""

from __future__ import annotations

import json
import sys

import preloaded
from conftest import REPO, SRC, assert_ok, run_trainer

COMMON = ["--log_interval", "10", "--checkpoint_freq", "0"]


def test_pretrain_sft_then_dpo_prefers_the_right_answer_on_held_out_pairs(session_cache, tmp_path):
    """The journey's three runs (2 CPU ranks each) and a generation, about 3 minutes on 2 cores, most of it the
    fine-tuning that teaches the tiny model the first 60 chats' answers. DPO on 30 of their pairs (the chat's answer
    chosen, the answer about another function rejected) teaches it to prefer the answer that belongs to the question
    on the 30 held out, whose chats it was fine-tuned on and whose pairs it never saw: their reward accuracy rises
    above 0.9 and their margin grows at every evaluation. The export generates."""
    pretrained = run_trainer(tmp_path / "pre", [*COMMON, "--seq_len", "128", "--micro_batch_size", "8",
                                                "--max_steps", "20", "--eval_interval", "0"])
    assert_ok(pretrained)
    tuned = run_trainer(tmp_path / "sft", [*COMMON, "--model", str(tmp_path / "pre" / "hf"), "--dataset",
                                           "embedded-chat", "--max_documents", "60", "--seq_len", "128",
                                           "--micro_batch_size", "8", "--max_steps", "160", "--learning_rate", "2e-3",
                                           "--eval_interval", "0"])
    assert_ok(tuned)
    dpo = run_trainer(tmp_path / "dpo", [*COMMON, "--model", str(tmp_path / "sft" / "hf"), "--dataset",
                                         "embedded-preference", "--preference", "dpo", "--max_documents", "30",
                                         "--seq_len", "96", "--micro_batch_size", "4", "--max_steps", "40",
                                         "--learning_rate", "5e-5", "--eval_interval", "10", "--eval_iters", "8"])
    assert_ok(dpo)
    assert "30 pairs" in dpo.output and "(+30 validation)" in dpo.output
    evaluations = [r for r in dpo.metrics() if "eval_loss" in r]
    margins = [r["eval_rewards/margins"] for r in evaluations]
    assert len(evaluations) == 4 and margins == sorted(margins) and margins[0] > 0, margins
    assert evaluations[-1]["eval_rewards/accuracies"] > 0.9, evaluations
    summary = json.loads((tmp_path / "dpo" / "summary.json").read_text())
    assert summary["final_pairs"]["validation"]["rewards/accuracies"] > 0.9
    generated = preloaded.run([sys.executable, "-m", "model_utils.generate", "--model", str(tmp_path / "dpo" / "hf"),
                               "--chat", "What does `json.dumps` do?", "--max_new_tokens", "16"], cwd=REPO,
                              env={"PYTHONPATH": str(SRC)}, capture_output=True, text=True, timeout=300)
    assert generated.returncode == 0 and generated.stdout.strip(), generated.stderr[-3000:]
