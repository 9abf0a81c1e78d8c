"""A run in one file for real: the LoRA fine-tuning example of configs/runs/ trained for 2 steps on 2 CPU ranks, and
the configuration rank 0 writes into the run directory, which --config takes to the same configuration."""

from __future__ import annotations

import torch
from conftest import REPO, assert_ok, run_trainer

from model_utils.config.flags import parse_args

EXAMPLE = REPO / "configs" / "runs" / "sft-lora.yaml"


def test_the_lora_example_trains_and_its_written_configuration_runs_the_same_again(session_cache, tmp_path):
    """The example with what a CPU and this machine need (a local model, short blocks, 2 steps instead of its 3
    epochs): its LoRA settings train, and CHECKPOINT_DIR/config.yaml gives the same configuration back."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    from model_utils.data.tokenizer import load_tokenizer

    model = tmp_path / "pretrained"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(Qwen3Config(
        vocab_size=8192, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16)).save_pretrained(model)
    load_tokenizer(None).save_pretrained(model)
    ckpt = tmp_path / "ckpt"
    args = ["--config", str(EXAMPLE), "--model", str(model), "--seq_len", "256", "--max_steps", "2",
            "--max_documents", "100", "--micro_batch_size", "2", "--eval_iters", "2", "--log_interval", "1", "--no-export"]
    run = run_trainer(ckpt, args)
    assert_ok(run)
    assert "LoRA: rank 16" in run.output, run.output
    assert [r["step"] for r in run.train_records()] == [1, 2]  # --max_steps replaced the file's --num_epochs
    written = ckpt / "config.yaml"
    assert f"config file: {written}" in run.output
    assert parse_args(["--config", str(written)]) == parse_args(["--checkpoint_dir", str(ckpt), *args])
