"""The preference journey on CPU, offline, as docs/PREFERENCE.md runs it: pretrain the tiny preset, fine-tune its export
on the embedded chats, tune that on the embedded pairs with DPO, export, generate."""

from __future__ import annotations

import json
import sys

import preloaded
from conftest import REPO, SRC, assert_ok, run_trainer

COMMON = ["--log_interval", "1", "--checkpoint_freq", "0"]


def test_pretrain_sft_then_dpo_prefers_the_chosen_answers_of_held_out_pairs(session_cache, tmp_path):
    """The journey's three runs (2 CPU ranks each) and a generation. DPO on 30 pairs of the chats' training split (the
    chat's answer chosen, the same answer in capitals rejected) teaches the fine-tuned tiny model the preference for
    the 30 pairs of the validation split, whose questions it was never tuned on: their reward accuracy rises above 0.9
    and their margin grows from one evaluation to the next. The export generates. About a minute of two cores."""
    pretrained = run_trainer(tmp_path / "pre", [*COMMON, "--seq_len", "128", "--micro_batch_size", "8",
                                                "--max_steps", "20", "--eval_interval", "0"])
    assert_ok(pretrained)
    tuned = run_trainer(tmp_path / "sft", [*COMMON, "--model", str(tmp_path / "pre" / "hf"), "--dataset",
                                           "embedded-chat", "--max_documents", "60", "--seq_len", "128",
                                           "--micro_batch_size", "8", "--max_steps", "20", "--learning_rate", "2e-3",
                                           "--eval_interval", "0"])
    assert_ok(tuned)
    dpo = run_trainer(tmp_path / "dpo", [*COMMON, "--model", str(tmp_path / "sft" / "hf"), "--dataset",
                                         "embedded-preference", "--preference", "dpo", "--max_documents", "30",
                                         "--seq_len", "192", "--micro_batch_size", "4", "--max_steps", "10",
                                         "--learning_rate", "1e-4", "--eval_interval", "5", "--eval_iters", "8"])
    assert_ok(dpo)
    assert "data: train: 30 pairs" in dpo.output and "data: validation: 30 pairs" in dpo.output
    first = dpo.train_records()[0]
    assert first["step"] == 1 and first["rewards/margins"] == 0.0  # the policy is its reference at the first step
    evaluations = [r for r in dpo.metrics() if "eval_loss" in r]
    margins = [r["eval_rewards/margins"] for r in evaluations]
    assert len(evaluations) == 2 and 0 < margins[0] < margins[1], margins
    assert evaluations[-1]["eval_rewards/accuracies"] > 0.9, evaluations
    summary = json.loads((tmp_path / "dpo" / "summary.json").read_text())
    assert summary["final_pairs"]["validation"]["rewards/accuracies"] > 0.9
    generated = preloaded.run([sys.executable, "-m", "model_utils.generate", "--model", str(tmp_path / "dpo" / "hf"),
                               "--prompt", "Return the", "--max_new_tokens", "16"], cwd=REPO,
                              env={"PYTHONPATH": str(SRC)}, capture_output=True, text=True, timeout=300)
    assert generated.returncode == 0 and generated.stdout.strip() != "Return the", generated.stderr[-3000:]
