"""Preference tuning through the trainer (real DeepSpeed on CPU ranks): DPO from a model with its reference stored
at step 0, the first loss ln 2, what every step logs, an exact resume after kill -9 that reads the reference again,
one rank against two, LoRA with its adapters off as the reference, ZeRO-3, a reference-free objective, and the input
it refuses."""

from __future__ import annotations

import json
import math
import sys

import pytest
import torch
import preloaded
from conftest import REPO, SRC, assert_ok, kill_after_checkpoint_then_resume, run_trainer

from model_utils.checkpoint.protocol import inspect_checkpoint

LN2 = math.log(2)
# Sequences of at most 48 tokens, blocks of 96 positions (a pair whole), 2 blocks a micro-batch.
ARGS = ["--preference", "dpo", "--seq_len", "48", "--micro_batch_size", "2", "--eval_iters", "2", "--log_interval",
        "1", "--eval_interval", "2", "--learning_rate", "1e-3", "--no-export"]
PAIR_KEYS = {"rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
             "logps/rejected"}


def pairs(count: int = 48) -> list[dict]:
    """TRL's conversational rows: the right sum is chosen, a wrong one rejected."""
    return [{"prompt": [{"role": "user", "content": f"What is {a} plus {b}?"}],
             "chosen": [{"role": "assistant", "content": f"{a + b}."}],
             "rejected": [{"role": "assistant", "content": f"Maybe {a + b + 1 + b % 3}."}]}
            for a in range(count // 4) for b in range(4)]


@pytest.fixture(scope="module")
def base_model(tmp_path_factory):
    """A randomly initialised tiny Qwen3 with the project's tokenizer: a local "pretrained" model."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    from model_utils.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(None)
    path = tmp_path_factory.mktemp("base") / "qwen3"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(Qwen3Config(
        vocab_size=-(-len(tokenizer) // 64) * 64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def pairs_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("pairs") / "pairs.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in pairs()))
    return path


@pytest.fixture(scope="module")
def dpo_runs(base_model, pairs_file, session_cache, tmp_path_factory):
    """The same 6-step DPO run uninterrupted and killed after its step-2 checkpoint, then resumed."""
    root = tmp_path_factory.mktemp("dpo")
    args = [*ARGS, "--model", str(base_model), "--dataset", str(pairs_file), "--max_steps", "6",
            "--checkpoint_freq", "2", "--validation_fraction", "0.25"]
    whole = run_trainer(root / "whole", args)
    assert_ok(whole)
    resumed = kill_after_checkpoint_then_resume(root / "resumed", args, step=2)
    return root, args, whole, resumed


def test_the_first_dpo_loss_is_ln2_and_every_step_logs_trls_values(dpo_runs):
    """Policy and reference are one model at step 0: every reward is 0 and the loss ln 2. The rewards, their margin
    and accuracy and the log-probabilities reach the log line, metrics.jsonl, TensorBoard and summary.json, for the
    training steps and the held-out pairs; the manifest records the objective and the reference."""
    root, _, whole, _ = dpo_runs
    records = whole.train_records()
    assert [r["step"] for r in records] == list(range(1, 7)) and PAIR_KEYS <= set(records[0])
    assert records[0]["loss"] == pytest.approx(LN2, abs=1e-6)
    assert records[0]["rewards/margins"] == 0 and records[0]["rewards/accuracies"] == 0
    assert records[0]["logps/chosen"] < 0 and records[-1]["rewards/margins"] > records[1]["rewards/margins"]
    assert "| rewards/accuracies " in whole.output and "preference: dpo, beta 0.1; reference: the step-0 model" \
        in whole.output
    evaluations = [r for r in whole.metrics() if "eval_loss" in r]
    assert [e["step"] for e in evaluations] == [2, 4, 6] and all(
        {f"eval_{key}" for key in PAIR_KEYS} <= set(e) for e in evaluations)
    summary = json.loads((root / "whole" / "summary.json").read_text())
    assert summary["preference"] == {"objective": "dpo", "beta": 0.1, "simpo_gamma": None}
    assert set(summary["final_pairs"]) == {"train", "validation"} and PAIR_KEYS == set(summary["final_pairs"]["train"])
    manifest = inspect_checkpoint(root / "whole" / "step-00000006").manifest
    assert manifest["preference"]["objective"] == "dpo" and manifest["reference"]["kind"] == "stored"
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(root / "whole" / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    assert {"train/rewards/accuracies", "eval/rewards/margins", "train/logps/chosen"} <= set(events.Tags()["scalars"])


def test_a_dpo_run_resumes_exactly_with_the_step0_reference(dpo_runs):
    """The losses and rewards of the resumed steps equal the uninterrupted run's; the resumed run reads the stored
    reference (of the step-0 model: it is never scored from trained weights) and its digest is the checkpoint's."""
    root, _, whole, resumed = dpo_runs
    first = whole.train_records_by_step()
    again = {step: r for step, r in resumed.train_records_by_step().items() if step > 2}
    assert sorted(again) == [3, 4, 5, 6]
    for step, record in again.items():
        for key in ("loss", "rewards/margins", "rewards/accuracies", "logps/chosen"):
            assert record[key] == pytest.approx(first[step][key], rel=1e-6, abs=1e-7), (step, key)
    assert "reference: the step-0 model's log-probabilities of" in resumed.output and " read from " in resumed.output
    digests = {inspect_checkpoint(root / run / "step-00000006").manifest["reference"]["digest"]
               for run in ("whole", "resumed")}
    assert len(digests) == 1


def test_one_rank_gives_two_ranks_losses_and_rewards(dpo_runs, tmp_path):
    """The same global batch (4 blocks a step) as 1 rank x 2 blocks x 2 micro-batches: every pair weighs the same
    wherever it is, so the loss, rewards and accuracy of each step equal the 2-rank run's."""
    _, args, whole, _ = dpo_runs
    one = run_trainer(tmp_path / "one", [*args, "--max_steps", "3", "--gradient_accumulation_steps", "2",
                                         "--checkpoint_freq", "0"], nproc=1)
    assert_ok(one)
    first = whole.train_records_by_step()
    for record in one.train_records():
        for key in ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "logps/rejected"):
            assert record[key] == pytest.approx(first[record["step"]][key], rel=1e-5, abs=1e-7), (record["step"], key)


def test_zero3_trains_the_same_pairs_alike(dpo_runs, tmp_path):
    """ZeRO-3 partitions the model; the LM head is gathered for the chunked log-probabilities in the forward and
    their recomputation: its first steps follow ZeRO-2's."""
    _, args, whole, _ = dpo_runs
    run = run_trainer(tmp_path / "z3", [*args, "--max_steps", "3", "--ds_config", "configs/zero3.json",
                                        "--checkpoint_freq", "0"])
    assert_ok(run)
    first = whole.train_records_by_step()
    for record in run.train_records():
        assert record["loss"] == pytest.approx(first[record["step"]]["loss"], rel=1e-4), record["step"]


def test_lora_dpo_takes_the_adapters_off_for_its_reference_and_exports(base_model, pairs_file, session_cache,
                                                                          tmp_path):
    """LoRA's B starts at zero, so the model with its adapters off, the reference, is the policy at step 0: the first
    loss is ln 2 without a stored reference. The tuned adapters export merged, and the merged model generates."""
    run = run_trainer(tmp_path / "lora", [*ARGS, "--model", str(base_model), "--dataset", str(pairs_file),
                                          "--max_steps", "4", "--checkpoint_freq", "0", "--lora_rank", "4",
                                          "--lora_dropout", "0", "--learning_rate", "1e-2", "--export",
                                          "--export_merged"])
    assert_ok(run)
    records = run.train_records()
    assert records[0]["loss"] == pytest.approx(LN2, abs=1e-6) and records[-1]["loss"] < LN2
    assert "reference: the model with its adapters off (LoRA)" in run.output and "reference: the step-0" not in \
        run.output
    generated = preloaded.run([sys.executable, "-m", "model_utils.generate", "--model",
                               str(tmp_path / "lora" / "hf" / "merged"), "--chat", "What is 2 plus 3?",
                               "--max_new_tokens", "4"], cwd=REPO, env={"PYTHONPATH": str(SRC)},
                              capture_output=True, text=True, timeout=300)
    assert generated.returncode == 0, generated.stderr[-3000:]


def test_orpo_needs_no_reference(base_model, pairs_file, session_cache, tmp_path):
    """ORPO scores the answers by their mean log-probability and adds the chosen answers' NLL: no reference is
    stored or computed, and its loss starts above ln 2 times beta by the NLL."""
    run = run_trainer(tmp_path / "orpo", [*ARGS, "--model", str(base_model), "--dataset", str(pairs_file),
                                          "--preference", "orpo", "--max_steps", "2", "--checkpoint_freq", "0",
                                          "--eval_interval", "0"], nproc=1)
    assert_ok(run)
    first = run.train_records()[0]
    assert "reference: none (reference-free)" in run.output and "log-probabilities of" not in run.output
    assert first["loss"] > 5 and first["rewards/chosen"] == pytest.approx(0.1 * first["logps/chosen"], rel=1e-6)


@pytest.mark.parametrize("extra, rows, message", [
    ([], "chats", "--dataset = {path}: --preference tunes on pairs of a better and a worse answer, and these rows "
                  "hold no chosen and rejected columns (columns: messages)"),
    (["--preference", "off"], "pairs", "--preference = off: the rows of {path} are preference pairs (columns: "
                                       "prompt, chosen, rejected)"),
])
def test_rows_and_the_preference_flag_that_disagree_stop_before_the_run(base_model, tmp_path, extra, rows, message):
    path = tmp_path / f"{rows}.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in (
        pairs(4) if rows == "pairs" else [{"messages": p["prompt"] + p["chosen"]} for p in pairs(4)])))
    run = run_trainer(tmp_path / "ckpt", [*ARGS, "--model", str(base_model), "--dataset", str(path), "--max_steps",
                                          "2", *extra], nproc=1)
    assert run.returncode == 2 and message.format(path=path) in run.output, run.output[-3000:]


def test_a_resume_with_another_objective_is_refused(dpo_runs):
    root, args, _, _ = dpo_runs
    run = run_trainer(root / "whole", [*args, "--preference", "ipo", "--max_steps", "8"], nproc=1)
    assert run.returncode == 2
    assert "--preference = ipo: " in run.output and "was tuned with --preference dpo" in run.output
