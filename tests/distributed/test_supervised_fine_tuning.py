"""Supervised fine-tuning through the trainer (real DeepSpeed on CPU ranks): loss on the answers of the embedded chat
data, LoRA with an exact resume and its exports, --num_epochs, and a tiny model of each family fine-tuned."""

from __future__ import annotations

import json
import math
import re
import sys

import pytest
import torch
import preloaded
from conftest import FAST_ARGS, REPO, SRC, assert_ok, kill_after_checkpoint_then_resume, run_trainer

SFT_ARGS = ["--seq_len", "64", "--micro_batch_size", "2", "--eval_iters", "2", "--log_interval", "1",
            "--eval_interval", "0", "--checkpoint_freq", "0"]


def chats(count: int = 48) -> list[dict]:
    return [{"messages": [{"role": "user", "content": f"What is {a} plus {b}?"},
                          {"role": "assistant", "content": f"{a} plus {b} is {a + b}."}]}
            for a in range(count // 4) for b in range(4)]


def save_tiny_model(path, config) -> None:
    """A randomly initialised model of `config` with the project's tokenizer: a local "pretrained" model."""
    from transformers import AutoModelForCausalLM

    from model_utils.data.tokenizer import load_tokenizer

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    load_tokenizer(None).save_pretrained(path)


def vocab() -> int:
    from model_utils.data.tokenizer import load_tokenizer

    return -(-len(load_tokenizer(None)) // 64) * 64


@pytest.fixture(scope="module")
def base_model(tmp_path_factory):
    from transformers import Qwen3Config

    path = tmp_path_factory.mktemp("base") / "qwen3"
    save_tiny_model(path, Qwen3Config(vocab_size=vocab(), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      tie_word_embeddings=False))
    return path


@pytest.fixture(scope="module")
def chat_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("chats") / "chats.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in chats()))
    return path


def loss_share(output: str) -> float:
    return float(re.search(r"tokens, ([\d.]+)% with loss", output).group(1))


def final_eval(output: str) -> float:
    return float(re.search(r"eval \(final\) step \d+: loss ([\d.]+)", output).group(1))


def test_masked_loss_on_the_embedded_chats_and_on_prompts_too(base_model, session_cache, tmp_path):
    """The data line and the losses follow --train_on_prompts: only the answers carry loss by default."""
    # Blocks of 256: the standard library's questions and the start of their answers fit.
    args = [*SFT_ARGS, "--seq_len", "256", "--model", str(base_model), "--dataset", "embedded-chat",
            "--max_documents", "100", "--max_steps", "2", "--no-export"]
    answers = run_trainer(tmp_path / "answers", args)
    everything = run_trainer(tmp_path / "everything", [*args, "--train_on_prompts"])
    assert_ok(answers)
    assert_ok(everything)
    assert "fine-tuning data (chat, default ChatML-like template" in answers.output
    assert "attention: within each example" in answers.output
    assert 0 < loss_share(answers.output) < 90 and loss_share(everything.output) == 100.0
    # The same model and blocks' positions, other targets: the first step's loss and the evaluation differ.
    assert answers.train_records()[0]["loss"] != pytest.approx(everything.train_records()[0]["loss"], abs=1e-3)
    assert final_eval(answers.output) != pytest.approx(final_eval(everything.output), abs=1e-3)
    # A pretrained model's defaults were taken (full fine-tuning: 2e-5) and said so.
    assert "fine-tuning defaults: learning rate 2e-05" in answers.output


def test_a_step_is_the_mean_over_its_loss_tokens_however_its_blocks_are_split(base_model, chat_file, session_cache,
                                                                              tmp_path):
    """Each micro-batch's mean loss weighs by its share of the step's answer tokens over all ranks, so a step's loss
    and update are the mean over those tokens: its 8 blocks as 2 ranks x 2 blocks x 2 micro-batches and as 2 ranks x
    4 blocks x 1 give the same losses, step after step (the blocks carry different numbers of answer tokens, so a
    mean of the micro-batches' means would differ). One rank reading the same 8 blocks as 4 x 2 micro-batches gives
    them too, and the same gradient norms (a weight that missed the ranks' share would scale both on 2 ranks alike,
    which the comparison between splits alone would not see). The evaluation weighs its tokens alike: the same 16 picks
    of the validation blocks as 4 x 2 ranks x 2, as 2 x 2 ranks x 4 and as 4 x 1 rank x 4 give the same final loss."""
    args = [*SFT_ARGS, "--model", str(base_model), "--dataset", str(chat_file), "--max_steps", "3", "--no-export",
            "--learning_rate", "1e-3", "--validation_fraction", "0.25"]
    split = run_trainer(tmp_path / "split", [*args, "--micro_batch_size", "2", "--gradient_accumulation_steps", "2",
                                             "--eval_iters", "4"])
    whole = run_trainer(tmp_path / "whole", [*args, "--micro_batch_size", "4", "--gradient_accumulation_steps", "1",
                                             "--eval_iters", "2"])
    one_rank = run_trainer(tmp_path / "one-rank", [*args, "--micro_batch_size", "4", "--gradient_accumulation_steps",
                                                   "2", "--eval_iters", "4"], nproc=1)
    for run in (split, whole, one_rank):
        assert_ok(run)
    split_losses = [r["loss"] for r in split.train_records()]
    whole_losses = [r["loss"] for r in whole.train_records()]
    assert len(split_losses) == 3 and split_losses[0] != split_losses[2]
    assert split_losses == pytest.approx(whole_losses, rel=1e-6)
    assert [r["loss"] for r in one_rank.train_records()] == pytest.approx(whole_losses, rel=1e-5)
    norms = [[r["grad_norm"] for r in run.train_records()] for run in (whole, one_rank)]
    assert norms[0] == pytest.approx(norms[1], rel=1e-5)
    evaluations = [[r["eval_loss"] for r in run.metrics() if "eval_loss" in r] for run in (split, whole, one_rank)]
    assert len(evaluations[0]) == 1 and evaluations[0] == pytest.approx(evaluations[1], rel=1e-6)
    assert evaluations[2] == pytest.approx(evaluations[1], rel=1e-5)


@pytest.fixture(scope="module")
def lora_runs(base_model, chat_file, session_cache, tmp_path_factory):
    """The same LoRA run for 2 epochs uninterrupted and killed after its step-2 checkpoint, then resumed."""
    root = tmp_path_factory.mktemp("lora")
    args = [*SFT_ARGS, "--model", str(base_model), "--dataset", str(chat_file), "--num_epochs", "2",
            "--lora_rank", "4", "--lora_alpha", "8", "--lora_dropout", "0", "--learning_rate", "1e-2",
            "--checkpoint_freq", "2", "--export_merged"]
    whole = run_trainer(root / "whole", args)
    assert_ok(whole)
    resumed = kill_after_checkpoint_then_resume(root / "resumed", args, step=2)
    return root, whole, resumed


def test_epochs_give_the_steps_of_the_packed_data(lora_runs):
    _, whole, resumed = lora_runs
    blocks = int(re.search(r"([\d,]+) training blocks \(\+", whole.output).group(1).replace(",", ""))
    expected = math.ceil(2 * (blocks // (2 * 2)))  # 2 epochs of blocks // (world x micro) micro-batches, 1 per step
    assert f"2 epochs = {expected} steps" in whole.output
    assert whole.train_records()[-1]["step"] == expected
    assert resumed.train_records()[-1]["step"] == expected  # the resumed run stops at the same step


def test_a_lora_run_resumes_exactly_from_adapters_and_optimizer_state(lora_runs):
    root, whole, resumed = lora_runs
    first = whole.losses_by_step()
    again = {step: loss for step, loss in resumed.losses_by_step().items() if step > 2}
    assert again and all(loss == pytest.approx(first[step], abs=1e-6) for step, loss in again.items())
    assert "LoRA: rank 4, alpha 8" in whole.output
    step = sorted((root / "resumed").glob("step-*"))[-1]  # the newest kept (retention removed step 2)
    module = torch.load(step / "mp_rank_00_model_states.pt", weights_only=False)["module"]
    assert module and all("lora_" in key for key in module)  # no frozen weight in the checkpoint
    assert json.loads((step / "manifest.json").read_text())["lora"]["rank"] == 4


def test_a_resume_with_other_adapters_is_refused(lora_runs, base_model, chat_file):
    root, _, _ = lora_runs
    other = run_trainer(root / "whole", [*SFT_ARGS, "--model", str(base_model), "--dataset", str(chat_file),
                                         "--num_epochs", "3", "--lora_rank", "8"])
    assert other.returncode == 2
    assert "--lora_rank = 8" in other.output and "trained with other adapters (rank 4 -> 8" in other.output


def test_adapter_and_merged_exports_give_the_same_logits(lora_runs, base_model, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    root, _, _ = lora_runs
    export = root / "whole" / "hf"
    probe = torch.arange(1, 17).reshape(1, 16)
    merged = AutoModelForCausalLM.from_pretrained(export / "merged").eval()
    adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_model), export / "adapter").eval()
    base = AutoModelForCausalLM.from_pretrained(base_model).eval()
    with torch.no_grad():
        expected = adapter(probe).logits
        torch.testing.assert_close(merged(probe).logits, expected, rtol=1e-4, atol=1e-4)
        assert not torch.allclose(base(probe).logits, expected, atol=1e-4)  # the adapters trained
    assert "<|im_start|>" in (export / "merged" / "chat_template.jinja").read_text()  # the template it trained with
    # The offline export of the last checkpoint writes the same adapters.
    offline = preloaded.run([sys.executable, "-m", "model_utils.export", str(root / "whole"), "--output",
                             str(tmp_path / "offline"), "--merged", "--dtype", "float32"], cwd=REPO,
                            env={"PYTHONPATH": str(SRC), **_env()}, capture_output=True, text=True, timeout=300)
    assert offline.returncode == 0, offline.stderr[-3000:]
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "offline" / "merged").eval()
    with torch.no_grad():
        torch.testing.assert_close(again(probe).logits, expected, rtol=1e-4, atol=1e-4)


def _env() -> dict:
    import os

    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def test_a_pretrained_model_without_data_is_refused(base_model, tmp_path):
    run = run_trainer(tmp_path / "ckpt", [*FAST_ARGS, "--model", str(base_model), "--max_steps", "2"], nproc=1)
    assert run.returncode == 2
    assert "--dataset = None: a pretrained model" in run.output and "--dataset embedded-chat" in run.output


def family_configs() -> dict:
    from transformers import GemmaConfig, GPT2Config, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2)
    return {"llama": lambda: LlamaConfig(vocab_size=vocab(), **common),
            "mistral": lambda: MistralConfig(vocab_size=vocab(), **common),
            "qwen2": lambda: Qwen2Config(vocab_size=vocab(), **common),
            "qwen3": lambda: Qwen3Config(vocab_size=vocab(), head_dim=16, **common),
            "gemma": lambda: GemmaConfig(vocab_size=vocab(), head_dim=16, **common),
            "gpt2": lambda: GPT2Config(vocab_size=vocab(), n_embd=64, n_layer=2, n_head=4, n_positions=256)}


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "gemma", "gpt2"])
def test_each_family_fine_tunes_with_lora(family, chat_file, session_cache, tmp_path):
    """A tiny random model of the family, saved locally, fine-tuned with LoRA for a few steps (one process) and
    exported merged: its default target layers exist, the loss is finite, the merged export loads."""
    from transformers import AutoModelForCausalLM

    save_tiny_model(tmp_path / "base", family_configs()[family]())
    run = run_trainer(tmp_path / "ckpt", [*SFT_ARGS, "--model", str(tmp_path / "base"), "--dataset", str(chat_file),
                                          "--max_steps", "2", "--lora_rank", "4", "--export_merged"], nproc=1)
    assert_ok(run)
    assert "LoRA: rank 4" in run.output
    assert all(math.isfinite(r["loss"]) for r in run.train_records())
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt" / "hf" / "merged")
    assert merged.config.model_type == family
