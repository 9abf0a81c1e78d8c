"""benchmarks/sft_bench.py's and fine_tuning_work.py's own arithmetic on CPU: the example tokens and attention pairs
counted in packed blocks and flattened bins, the global batch both sides share, the runs of an invocation, and the loss
comparison; and the llama-1b preset it benchmarks beside Qwen3."""

from __future__ import annotations

import sys
from argparse import Namespace
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))


def test_example_lengths_of_a_packed_block_leave_out_its_padding():
    """Ours: examples of 3 and 2 positions, then 3 of padding (targets -100); a full block has no padding run."""
    import fine_tuning_work

    positions = np.array([0, 1, 2, 0, 1, 0, 1, 2])
    targets = np.array([-100, 7, 8, -100, 9, -100, -100, -100])
    assert fine_tuning_work.segment_lengths(positions) == [3, 2, 3]
    assert fine_tuning_work.block_example_lengths(positions, targets) == [3, 2]
    full = np.array([-100, 7, 8, -100, 9, -100, 4, 5])
    assert fine_tuning_work.block_example_lengths(positions, full) == [3, 2, 3]
    assert fine_tuning_work.work_of([3, 2]) == (5, 13)
    # TRL's flattened bins: one row, positions restarting per example, no padding.
    assert fine_tuning_work.segment_lengths(np.array([[0, 1, 0, 1, 2, 3]])) == [2, 4]


def bench_args(**overrides) -> Namespace:
    values = dict(micro_batch_size=[2, 4], peer_micro_batch_size=[1, 3], nproc=1, seq_len=1024,
                  global_batch_tokens=None, modes=["full", "lora"], skip=[], steps=3, warmup=1, seed=5,
                  ds_config="ds_config.json", zero_stage=None, ds_set=[], gradient_checkpointing=False, lora_rank=16,
                  lora_alpha=32.0, lora_target_modules=None, peer_liger="on", peer_attn="sdpa",
                  attention_kernel="varlen", peer_packing="bfd", lora_dropout=0.05, peer="trl")
    return Namespace(**{**values, **overrides})


def test_global_batch_is_whole_steps_for_every_micro_batch_of_both_sides():
    import fine_tuning_work
    import sft_bench

    assert sft_bench.global_batch(bench_args()) == 12 * 1024  # lcm of 1, 2, 3, 4 blocks
    assert sft_bench.global_batch(bench_args(global_batch_tokens=24 * 1024)) == 24 * 1024
    with pytest.raises(fine_tuning_work.BenchProblem, match="not a multiple of micro-batch 3 x 1 GPU"):
        sft_bench.global_batch(bench_args(global_batch_tokens=16 * 1024))


def test_unpacked_peer_micro_batches_count_examples_not_blocks():
    """--peer-packing none: the peer's micro-batches hold padded examples, so only ours must make whole steps of the
    global batch; the peer takes as many examples per step as the blocks hold at the examples' mean length."""
    import sft_bench
    import sft_peers

    args = bench_args(peer_packing="none", peer_micro_batch_size=[3, 7])
    assert sft_bench.global_batch(args) == 4 * 1024  # lcm of ours' 2 and 4 blocks
    assert sft_peers.examples_accumulation(4 * 1024, 300.0, 7) == 2  # 13.7 examples in micro-batches of 7
    assert sft_peers.examples_accumulation(1024, 2000.0, 8) == 1  # at least one micro-batch
    jobs = sft_bench.make_jobs(args, Path("/m"), Path("/r"), Path("/c"), 4096)
    names = [j["name"] for j in jobs if j["side"] == "trl"]
    assert names == ["trl-full-mb3-none", "trl-full-mb7-none", "trl-lora-mb3-none", "trl-lora-mb7-none"]


def test_the_peers_tokens_are_its_examples_not_padding():
    """Padded rows count their attention mask's tokens; packed rows the runs of their positions."""
    import fine_tuning_work
    import torch

    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    assert fine_tuning_work.peer_example_lengths("none", mask.numel(), None, mask.sum(-1)) == [3, 5, 1]
    assert fine_tuning_work.peer_example_lengths("grouped", mask.numel(), None, mask.sum(-1)) == [3, 5, 1]
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])
    assert fine_tuning_work.peer_example_lengths("bfd", 9, positions, None) == [3, 2, 4]
    assert fine_tuning_work.work_of([3, 5, 1]) == (9, 35)


def test_jobs_per_mode_each_side_at_its_micro_batches_with_the_same_global_batch():
    import fine_tuning_work
    import sft_bench

    jobs = sft_bench.make_jobs(bench_args(), Path("/m"), Path("/rows.jsonl"), Path("/cache"), 12 * 1024)
    assert [j["name"] for j in jobs] == [
        "ours-full-mb2-ga6", "ours-full-mb4-ga3", "trl-full-mb1-ga12", "trl-full-mb3-ga4",
        "ours-lora-mb2-ga6", "ours-lora-mb4-ga3", "trl-lora-mb1-ga12", "trl-lora-mb3-ga4"]
    only_ours = sft_bench.make_jobs(bench_args(skip=["trl"], modes=["lora"]), Path("/m"), Path("/r"), Path("/c"),
                                    12 * 1024)
    assert [j["name"] for j in only_ours] == ["ours-lora-mb2-ga6", "ours-lora-mb4-ga3"]
    lora = next(j for j in jobs if j["mode"] == "lora")
    argv = fine_tuning_work.trainer_argv(lora, Path("/tmp"))
    assert argv[argv.index("--lora_rank") + 1] == "16" and argv[argv.index("--data_format") + 1] == "chat"
    assert argv[argv.index("--global_batch_tokens") + 1] == str(12 * 1024)
    assert argv[argv.index("--attention_kernel") + 1] == "varlen"  # our side's kernel, as asked


def test_losses_compared_over_the_same_steps():
    import fine_tuning_work

    compared = fine_tuning_work.compare_losses([10.0, 9.0, 8.0, 7.0], [10.5, 9.5, 8.5])
    assert compared["steps"] == 3 and compared["ours_first"] == [10.0, 9.0, 8.0]
    assert compared["mean_diff"] == pytest.approx(-0.5)
    assert fine_tuning_work.compare_losses([], [1.0]) == {}


def test_the_summary_gives_both_ratios_and_the_kernels_each_side_ran():
    """The headline ratio is by mean step time (tokens/s over the timed steps), beside the ratio of tokens/s at the
    median steps, which a stall does not move, each side at its own tokens per step (the sides pack the same blocks
    into different example tokens); each side's attention and Liger are the ones recorded from the runs."""
    import sft_bench

    jobs = [{"name": f"{side}-{mb}", "side": side, "mode": "full", "micro_batch_size": mb}
            for side, mb in (("ours", 8), ("trl", 4), ("trl", 8))]
    run = {"data_loss_tokens": 100, "losses": [2.0, 1.5]}
    results = [{**run, "tokens_per_s_per_gpu": 300.0, "step_s_median": 1.0, "tokens_per_step_per_gpu": 320.0,
                "attention": "varlen", "liger": "flce"},
               {**run, "tokens_per_s_per_gpu": 150.0, "step_s_median": 1.6, "tokens_per_step_per_gpu": 300.0,
                "attention": "sdpa", "liger": True},
               {**run, "tokens_per_s_per_gpu": 100.0, "step_s_median": 1.2, "tokens_per_step_per_gpu": 300.0,
                "attention": "sdpa", "liger": True}]
    text, record = sft_bench.summary(jobs, results, ["full"])
    assert record["full"]["peer"] == "trl-4" and record["full"]["ratio"] == pytest.approx(2.0)
    assert record["full"]["ratio_by_median_step"] == pytest.approx((320 / 1.0) / (300 / 1.6))  # 1.71, not 1.6
    assert record["full"]["kernels"] == {"ours": {"attention": "varlen", "liger": "flce"},
                                         "peer": {"attention": "sdpa", "liger": True}}
    assert "2.00x by mean step time, 1.71x by median (attention: ours varlen, TRL sdpa" in text


def test_liger_is_found_where_trainer_put_it():
    import types

    import fine_tuning_work
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.LayerNorm(2))
    assert not fine_tuning_work.liger_applied(model)
    norm = types.new_class("LigerRMSNorm", (torch.nn.Module,))
    norm.__module__ = "liger_kernel.transformers.rms_norm"  # a module swapped for Liger's class
    assert fine_tuning_work.liger_applied(torch.nn.Sequential(torch.nn.Linear(2, 2), norm()))
    forward = types.FunctionType(compile("def lce_forward(self, x): return x", "liger", "exec").co_consts[0],
                                 {"__name__": "liger_kernel.transformers.model.llama"})
    model[0].forward = types.MethodType(forward, model[0])  # a forward swapped for Liger's function
    assert fine_tuning_work.liger_applied(model)


def test_llama_1b_preset_is_llama_3_2_1b_in_transformers_llama_architecture():
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from model_utils.config.presets import default_seq_len
    from model_utils.config.settings import LoraSettings
    from model_utils.data.tokenizer import load_tokenizer
    from model_utils.models.build import model_config
    from model_utils.models.lora import target_modules_for

    config = model_config("llama-1b", load_tokenizer(None))
    assert isinstance(config, LlamaConfig) and config.model_type == "llama"
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert sum(p.numel() for p in model.parameters()) == 1_235_814_400
    assert "q_proj" in target_modules_for(config, LoraSettings(rank=16))
    assert default_seq_len("llama-1b") == 4096
