"""Preflight: one case per problem it must catch; each exits 2 in seconds naming the setting and the fix.

The cases run `python src/train_deepspeed.py --preflight` as a user would (no process group, no model built).
GPU memory cannot exist here, so its case gives the GPU size through GPU_MEMORY_GIB (the one stand-in).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, TRAINER, preflight_command
from inputs import SHIPPED, ds_with, set_key

from model_utils.models.memory import GIB


def _rename(section, old, new):
    def mutate(cfg):
        cfg[section]["params"][new] = cfg[section]["params"].pop(old)
    return mutate


def _saved_dataset(tmp_path, rows):
    import datasets

    datasets.Dataset.from_dict(rows).save_to_disk(tmp_path / "data")
    return str(tmp_path / "data")


def _checkpoint_of_other_model(tmp_path):
    step = tmp_path / "ckpt" / "step-00000010"
    step.mkdir(parents=True)
    (step / "manifest.json").write_text(json.dumps({"step": 10, "world_size": 1, "files": {}, "model": "qwen3-0.6b"}))
    return ["--checkpoint_dir", str(tmp_path / "ckpt")]


def _checkpoint_of_other_seq_len(tmp_path):
    step = tmp_path / "ckpt" / "step-00000010"
    step.mkdir(parents=True)
    (step / "manifest.json").write_text(json.dumps({"step": 10, "world_size": 1, "files": {}, "seq_len": 256}))
    return ["--checkpoint_dir", str(tmp_path / "ckpt"), "--seq_len", "128"]


def _unwritable_checkpoint_dir(tmp_path):
    target = tmp_path / "file-not-dir"
    target.write_text("")
    return ["--checkpoint_dir", str(target / "ckpt")]


# (id, args builder(tmp_path) -> extra args, env, setting that must be named, words of the fix)
CASES = [
    ("invalid-json", lambda t: ["--ds_config", _write(t, "{\n 'a': 1,\n}")], {}, "--ds_config", "fix the JSON syntax"),
    ("missing-ds-config", lambda t: ["--ds_config", str(t / "none.json")], {}, "--ds_config", "DeepSpeed JSON file"),
    ("attention-dropout-not-a-probability", lambda t: ["--attention_dropout", "1.5"], {}, "--attention_dropout",
     "leave it out for the model's own"),
    ("unknown-top-level-key", lambda t: ["--ds_config", ds_with(t, set_key(["gradient_cliping"], 1.0))], {},
     "ds_config gradient_cliping", "did you mean `gradient_clipping`?"),
    ("misspelt-zero-key", lambda t: ["--ds_config", ds_with(t, set_key(["zero_optimization", "overlap_com"], True))], {},
     "ds_config zero_optimization.overlap_com", "`overlap_comm`"),
    ("misspelt-offload-key", lambda t: ["--ds_config", ds_with(t, set_key(["zero_optimization", "offload_optimizer"],
                                                                        {"device": "cpu", "pin_memroy": True}))], {},
     "ds_config zero_optimization.offload_optimizer.pin_memroy", "`pin_memory`"),
    ("seed-scheduler-key", lambda t: ["--ds_config", ds_with(t, _rename("scheduler", "cos_min_ratio", "cosine_min_ratio"))],
     {}, "scheduler.params.cosine_min_ratio", "`cos_min_ratio`"),
    ("optimizer-param", lambda t: ["--ds_config", ds_with(t, set_key(["optimizer", "params", "betas1"], 0.9))], {},
     "optimizer.params.betas1", "`betas`"),
    ("batch-vs-world", lambda t: ["--ds_config", ds_with(t, lambda c: c.update(train_batch_size=64,
                                                                                train_micro_batch_size_per_gpu=8))],
     {"WORLD_SIZE": "3"}, "train_batch_size", "is not a multiple of micro-batch 8 x world size 3"),
    ("global-batch-vs-seq-len", lambda t: ["--global_batch_tokens", "1000"], {}, "--global_batch_tokens",
     "use a multiple of 256, e.g. 768 or 1024"),
    ("accumulation-vs-global-batch", lambda t: ["--global_batch_tokens", "4096", "--micro_batch_size", "4",
                                                "--gradient_accumulation_steps", "2"], {},
     "--gradient_accumulation_steps", "16 blocks / (micro 4 x world 1) = 4"),
    ("warmup-too-long", lambda t: ["--max_steps", "100", "--warmup_steps", "500"], {},
     "scheduler.params.warmup_num_steps", "raise --max_steps"),
    ("warmup-zero", lambda t: ["--warmup_steps", "0"], {}, "scheduler.params.warmup_num_steps", "use 1"),
    ("dataset-missing", lambda t: ["--dataset", str(t / "nope"), "--local_dataset", "true"], {}, "--dataset",
     "fix the path"),
    ("text-column-missing", lambda t: ["--dataset", _saved_dataset(t, {"body": ["some text"] * 5})], {},
     "--text_column", "columns: body"),
    ("empty-after-tokenization", lambda t: ["--dataset", _saved_dataset(t, {"text": [""] * 5})], {}, "--text_column",
     "hold no text"),
    ("too-little-data-per-rank", lambda t: ["--dataset", _saved_dataset(t, {"text": ["tiny doc"] * 5}), "--seq_len", "512"],
     {"WORLD_SIZE": "2"}, "--seq_len", "fewer than one micro-batch per rank"),
    ("tokenizer-larger-than-vocab", lambda t: ["--model", _small_pretrained(t), "--tokenizer", "default"], {},
     "--tokenizer", "use the model's own tokenizer"),
    ("model-dir-without-tokenizer", lambda t: ["--model", _small_pretrained(t)], {}, "--tokenizer",
     "the tokenizer the model was trained with"),
    ("tokenizer-missing", lambda t: ["--tokenizer", str(t / "no-tokenizer")], {}, "--tokenizer", "local tokenizer"),
    ("seq-len-beyond-positions", lambda t: ["--seq_len", "4096"], {}, "--seq_len", "use --seq_len 2048 or less"),
    ("checkpoint-dir-not-writable", _unwritable_checkpoint_dir, {}, "--checkpoint_dir", "choose a directory path"),
    ("checkpoint-space", lambda t: ["--keep_last_checkpoints", "2", "--model", "qwen3-8b", "--fused_kernels", "off"],
     {}, "--keep_last_checkpoints", "keep fewer checkpoints"),  # 3 x ~120 GiB: more than this disk has
    ("checkpoint-of-other-model", _checkpoint_of_other_model, {}, "--model", "use --model qwen3-0.6b"),
    ("checkpoint-of-other-seq-len", _checkpoint_of_other_seq_len, {}, "--seq_len = 128: ",
     "resume with --seq_len 256, or start a new run in another --checkpoint_dir"),
    ("gpu-memory", lambda t: ["--model", "qwen3-8b", "--fused_kernels", "off"], {"GPU_MEMORY_GIB": "80"},
     "train_micro_batch_size_per_gpu / zero_optimization", "cheapest configuration that fits"),
    ("fused-kernels-without-gpu", lambda t: ["--fused_kernels", "on"], {}, "--fused_kernels", "--fused_kernels auto"),
    ("document-mask-without-attention-mask", lambda t: ["--model", _attention_free_pretrained(t), "--tokenizer",
                                                        "default", "--document_mask"], {},
     "--document_mask", "leave out --document_mask"),
]


def _write(tmp_path, text):
    path = tmp_path / "bad.json"
    path.write_text(text)
    return str(path)


def _small_pretrained(tmp_path):
    """A pretrained model whose embedding (1000 rows) is smaller than the default tokenizer (8192)."""
    from transformers import Qwen3Config

    path = tmp_path / "small-model"
    Qwen3Config(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, head_dim=32).save_pretrained(path)
    return str(path)


def _attention_free_pretrained(tmp_path):
    """A model transformers builds without create_causal_mask (Mamba: no attention), so no mask per document."""
    from transformers import MambaConfig

    path = tmp_path / "mamba-model"
    MambaConfig(vocab_size=8192, hidden_size=64, state_size=4, num_hidden_layers=1).save_pretrained(path)
    return str(path)


def preflight_in_process(args, env, monkeypatch, capsys):
    """The same entry point called in this process: the table's cases skip a cold import of torch and DeepSpeed."""
    import train_deepspeed

    monkeypatch.setenv("WORLD_SIZE", "1")
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    t0 = time.monotonic()
    code = train_deepspeed.main(["--preflight", *args])
    captured = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, captured.out, captured.err), time.monotonic() - t0


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_preflight_catches(case, tmp_path, session_cache, monkeypatch, capsys):
    _, build, env, setting, fix = case
    args = build(tmp_path)
    if "--checkpoint_dir" not in args:
        args += ["--checkpoint_dir", str(tmp_path / "default-ckpt")]
    monkeypatch.chdir(tmp_path)
    proc, seconds = preflight_in_process(args, env, monkeypatch, capsys)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    problem_lines = [line for line in out.splitlines() if line.startswith("  - ")]
    assert any(line.startswith(f"  - {setting}") for line in problem_lines), out
    assert fix in out, out
    assert "Traceback" not in out
    assert seconds < 20  # seconds, not a model load


def test_preflight_names_an_incomplete_checkpoint_and_moves_nothing(tmp_path, session_cache, monkeypatch, capsys):
    """A save cut short does not stop a start: the preflight says the run will move it aside; it moves nothing."""
    step = tmp_path / "ckpt" / "step-00000010"
    step.mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    proc, _ = preflight_in_process(["--checkpoint_dir", str(tmp_path / "ckpt")], {}, monkeypatch, capsys)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (f"note: checkpoint: step-00000010 is incomplete ({step / 'manifest.json'} is missing (the save did not "
            f"finish)): the run will move it to {tmp_path / 'ckpt' / 'incomplete'} and not resume from it"
            ) in proc.stdout
    assert step.is_dir() and not (tmp_path / "ckpt" / "incomplete").exists()


def test_max_documents_counts_in_the_data_check(tmp_path, session_cache, monkeypatch, capsys):
    """The same data passes with all its documents and is too small with only the first three of them."""
    docs = [f"Document {i} holds a few words about packing and sharding data." for i in range(400)]
    args = ["--dataset", _saved_dataset(tmp_path, {"text": docs}), "--seq_len", "128",
            "--checkpoint_dir", str(tmp_path / "ckpt")]
    monkeypatch.chdir(tmp_path)
    everything, _ = preflight_in_process(args, {"WORLD_SIZE": "2"}, monkeypatch, capsys)
    assert everything.returncode == 0, everything.stdout + everything.stderr
    first_three, _ = preflight_in_process([*args, "--max_documents", "3"], {"WORLD_SIZE": "2"}, monkeypatch, capsys)
    assert first_three.returncode == 2 and "fewer than one micro-batch per rank" in first_three.stdout, first_three.stdout


def test_several_problems_are_reported_together(tmp_path, session_cache):
    bad = ds_with(tmp_path, lambda c: (_rename("scheduler", "cos_min_ratio", "cosine_min_ratio")(c),
                                       c["zero_optimization"].update(overlap_com=True),
                                       c.update(train_batch_size=12, train_micro_batch_size_per_gpu=8)))
    proc, _ = preflight_command(["--ds_config", bad, "--checkpoint_dir", str(tmp_path / "c")], {}, tmp_path)
    assert proc.returncode == 2
    assert "preflight: 3 problem(s)" in proc.stdout


def test_gpu_memory_estimate_of_the_default_path_matches_the_h100_measurements(tmp_path, session_cache, monkeypatch,
                                                                                capsys, ample_disk):
    """On a login node without Liger (simulated), planning the default path for an 80 GiB GPU: the estimate assumes the
    GPU nodes' fused cross-entropy and lands near what one H100 measured (docs/PERFORMANCE.md: 39.6 GiB at micro-batch
    8, 70.3 at 16), so a configuration that runs is not refused; the unfused loss's logits still are."""
    import re

    from model_utils.models import speed

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(speed, "liger_available", lambda: False)
    base = ["--model", "qwen3-0.6b", "--dummy_data", "64", "--checkpoint_dir", str(tmp_path / "ckpt")]
    estimates = {}
    for micro in (8, 16):
        proc, _ = preflight_in_process([*base, "--micro_batch_size", str(micro)], {"GPU_MEMORY_GIB": "80"},
                                       monkeypatch, capsys)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        estimates[micro] = float(re.search(r"memory: ~([\d.]+) GiB per GPU", proc.stdout).group(1))
        assert "assumes Liger's fused cross-entropy on the GPU nodes" in proc.stdout
    assert 37 < estimates[8] < 43 and 66 < estimates[16] < 75, estimates
    proc, _ = preflight_in_process([*base, "--micro_batch_size", "8", "--fused_kernels", "off"],
                                   {"GPU_MEMORY_GIB": "80"}, monkeypatch, capsys)
    assert proc.returncode == 2 and "train_micro_batch_size_per_gpu 4" in proc.stdout


H100, H200 = 79.2, 139.8  # GiB, as torch reports them
# The threshold the partitioned ZeRO-3 runs were measured with (Hugging Face's 10 x hidden): "auto" would keep their
# parameters whole where that fits.
PARTITIONED = {"stage3_param_persistence_threshold": 40_960}
# Qwen3-8B's partial offload on one H200 (a 128 GiB node): 0.55 of the optimizer offloaded, the parameters on the GPU
PARTIAL_8B = {"offload_optimizer": {"device": "cpu", "pin_memory": True, "ratio": 0.55},
              "offload_param": {"device": "none"}}


def _estimate_gib(model, setup, micro, gpu_gib, world, zero_changes, monkeypatch, tmp_path) -> float:
    """The preflight's peak estimate for one GPU of `world` (the GPU path planned from a login node, as the run's own
    start plans it on the GPU). `setup`: a config, "without" a top-level section of it, then the trainer's flags;
    `zero_changes` replace sections of its zero_optimization."""
    from model_utils.models.memory import GIB

    return _plan(model, setup, micro, gpu_gib, world, zero_changes, monkeypatch, tmp_path).memory.phases.peak[1] / GIB


def _plan(model, setup, micro, gpu_gib, world, zero_changes, monkeypatch, tmp_path):
    """The plan behind _estimate_gib."""
    from model_utils.config.flags import parse_args
    from model_utils.models import speed
    from model_utils.planning.plan import make_plan

    monkeypatch.setenv("GPU_MEMORY_GIB", str(gpu_gib))
    monkeypatch.setattr(speed, "liger_available", lambda: True)
    config_part, *flags = setup.split(" --")
    path, _, dropped = config_part.partition(" without ")
    config = json.loads((REPO / path).read_text())
    config.pop(dropped, None)
    config["zero_optimization"].update(zero_changes)
    (tmp_path / "ds.json").write_text(json.dumps(config))
    cfg = parse_args(["--model", model, "--ds_config", str(tmp_path / "ds.json"), "--micro_batch_size", str(micro),
                      "--dummy_data", "64", "--checkpoint_dir", "/nonexistent/ckpt", "--no-export",
                      *(f"--{flag}" for flag in flags)])
    return make_plan(cfg, world, decides=False)


@pytest.mark.parametrize("model, setup, micro, gpu_gib, world, zero_changes, measured", [
    # docs/JOURNEY.md and PERFORMANCE.md: peak allocated GiB; one H100 unless said
    ("qwen3-0.6b", "ds_config.json", 8, H100, 1, {}, 39.6),
    ("qwen3-0.6b", "ds_config.json", 16, H100, 1, {}, 70.3),
    # h100-2026-11-26.jsonl: two micro-batches a step hold the first one's gradients at the second's peak
    ("qwen3-0.6b", "ds_config.json --global_batch_tokens=65536", 8, H100, 1, {}, 40.7),
    ("qwen3-0.6b", "configs/zero1.json", 8, H100, 1, {}, 39.2),
    # measured with eager ZeRO-3 layers
    ("qwen3-0.6b", "configs/zero3.json --compile=off", 8, H100, 1, PARTITIONED, 48.7),
    ("qwen3-0.6b", "configs/zero3-offload.json", 8, H100, 1, {}, 40.9),
    ("qwen3-0.6b", "configs/zero2-offload.json", 8, H100, 1, {}, 33.2),  # the preset's journey: +6%, the safe side
    ("qwen3-4b", "configs/zero2-offload.json", 2, H100, 1, {}, 47.4),  # the fp32 accumulation buffer on the GPU
    # h100-2026-11-26.jsonl: the delayed update with its prefetch buffer (auto's choice here)
    ("qwen3-4b", "configs/zero2-offload.json --delayed_update_from_step=1", 2, H100, 1, {}, 54.9),
    # ...and without it at micro-batch 1 and 4 (4 x 8: the fastest measured, above auto's 90% by the estimate)
    ("qwen3-4b", "configs/zero2-offload.json --delayed_update_from_step=1 --delayed_update_prefetch=off", 1, H100, 1,
     {}, 36.1),
    ("qwen3-4b", "configs/zero2-offload.json --delayed_update_from_step=1", 4, H100, 1, {}, 70.0),
    ("qwen3-4b", "configs/zero2-offload.json without data_types", 2, H100, 1, {}, 32.5),  # DeepSpeed's offload default
    # h100x2-2026-11-26.jsonl: two H100 of one host, 131,072 tokens per step
    ("qwen3-4b", "configs/zero2-offload.json", 2, H100, 2, {}, 39.9),
    ("qwen3-4b", "configs/zero2-offload.json", 4, H100, 2, {}, 62.5),
    ("qwen3-4b", "configs/zero3-offload.json", 2, H100, 1, {}, 33.3),  # layers not compiled, parameters offloaded
    ("qwen3-4b", "configs/zero3-offload.json", 4, H100, 1, {}, 63.9),  # auto's choice at 131,072 tokens/step
    ("qwen3-4b", "configs/zero3-offload.json --gradient_checkpointing", 16, H100, 1, {}, 21.9),  # auto's, checkpointed
    # h100-2026-11-26.jsonl: the last 7 and 8 layers keep their activations (8: --checkpointed_layers auto's)
    ("qwen3-4b", "configs/zero3-offload.json --gradient_checkpointing --checkpointed_layers=29", 16, H100, 1, {}, 62.0),
    ("qwen3-4b", "configs/zero3-offload.json --gradient_checkpointing --checkpointed_layers=28", 16, H100, 1, {}, 68.4),
    # h200-2026-11-26.jsonl: one H200, the partial offload at micro-batch 1 and at auto's choice with checkpointing
    ("qwen3-8b", "configs/zero3-offload.json", 1, H200, 1, PARTIAL_8B, 99.2),
    ("qwen3-8b", "configs/zero3-offload.json --gradient_checkpointing", 16, H200, 1, PARTIAL_8B, 103.6),
    # h200x2-2026-11-26.jsonl, one GPU of two: auto's choices with the estimate's tensor count, 2 x 16 and 33 of 36
    ("qwen3-8b", "configs/zero3-offload.json", 2, H200, 1, PARTIAL_8B, 118.1),
    ("qwen3-8b", "configs/zero3-offload.json --gradient_checkpointing --checkpointed_layers=33", 16, H200, 1,
     PARTIAL_8B, 124.6),
    # h200x2-2026-11-26.jsonl: two H200 of one host, the seeds' config shape, auto's choice on an H100
    ("qwen3-8b", "configs/zero2-offload.json", 2, H200, 2, {}, 65.0),
    # ...and auto's choice on an H200, 4 x 8, without and with the delayed update's prefetch buffer
    ("qwen3-8b", "configs/zero2-offload.json", 4, H200, 2, {}, 91.7),
    ("qwen3-8b", "configs/zero2-offload.json --delayed_update_from_step=1 --delayed_update_prefetch=on", 4, H200, 2,
     {}, 99.3),
    # h200x4-2026-11-21.jsonl (SDPA, eager)
    ("qwen3-8b", "configs/zero3.json --compile=off", 2, H200, 4, PARTITIONED, 72.2),
    # h200x4-2026-11-27.jsonl: 262,144 tokens per step, the layers compiled (leaf modules) and eager
    ("qwen3-8b", "configs/zero3.json --global_batch_tokens=262144", 4, H200, 4, PARTITIONED, 91.1),
    ("qwen3-8b", "configs/zero3.json --global_batch_tokens=262144 --compile=off", 4, H200, 4, PARTITIONED, 110.7),
    # h100x4-2026-11-27.jsonl: the Llama-2-7B-shaped preset at 4096 tokens, the layers compiled (leaf modules)
    ("llama-7b", "configs/zero3.json --global_batch_tokens=262144", 2, H100, 4, PARTITIONED, 51.4),
    # h200x4-2026-11-27-whole-parameters.jsonl: every parameter whole on each GPU ("auto" persistence's choice)
    ("llama-7b", "configs/zero3.json --global_batch_tokens=262144", 2, H200, 4, {}, 61.6),
    ("llama-7b", "configs/zero3.json --global_batch_tokens=262144", 4, H200, 4, {}, 85.2),
    ("qwen3-8b", "configs/zero3.json --global_batch_tokens=262144", 4, H200, 4, {}, 101.9),
    ("qwen3-8b", "configs/zero3.json --global_batch_tokens=262144", 2, H200, 2, {}, 105.0),
    # docs/JOURNEY-FINE-TUNING.md's seeds-large: the preset as a Hugging Face model, chats in 2048-token blocks, auto's 14, whole
    ("llama-7b", "configs/zero3.json --seq_len=2048", 14, H200, 4, {}, 120.6),
    # docs/JOURNEY-FINE-TUNING.md's sft-lora: Llama 3.2 1B's dimensions, LoRA rank 16 with dropout, at 2048 tokens; 27 is auto's
    ("llama-1b", "ds_config.json --lora_rank=16 --seq_len=2048", 27, H100, 1, {}, 68.2),
    ("llama-1b", "ds_config.json --lora_rank=16 --seq_len=2048", 29, H100, 1, {}, 73.1),
    # h200x2-2026-11-26.jsonl: parameters and optimizer offloaded, auto's choice with checkpointing, and 9 layers kept
    ("qwen3-8b", "configs/zero3-offload.json --gradient_checkpointing", 16, H200, 2, {}, 30.0),
    ("qwen3-8b", "configs/zero3-offload.json --gradient_checkpointing --checkpointed_layers=27", 16, H200, 2, {}, 98.3),
    ("qwen3-8b", "configs/zero3-offload.json --gradient_checkpointing --checkpointed_layers=24", 16, H200, 2, {}, 122.0),
])
def test_memory_estimate_is_within_10_percent_of_the_measured_peaks(model, setup, micro, gpu_gib, world, zero_changes,
                                                                   measured, monkeypatch, session_cache, tmp_path):
    """The automatic micro-batch trusts the estimate: each measured peak is within 10% of it, those of eager layers
    (ZeRO-3 with the parameters offloaded, --compile off), whose activations are counted tensor by tensor, within 5%."""
    estimate = _estimate_gib(model, setup, micro, gpu_gib, world, zero_changes, monkeypatch, tmp_path)
    tolerance = 0.05 if "zero3-offload" in setup or "compile=off" in setup else 0.10
    assert abs(estimate - measured) <= tolerance * measured, (estimate, measured)


def test_the_layer_counts_equal_the_layers_measured_on_the_gpu():
    """What one decoder layer keeps per token, measured on one H100 by benchmarks/layer_activations.py (1 and 3
    layers, micro-batches 1 and 2, SDPA and FlashAttention-4): compiled, the estimate's count exactly; eager, its 16-bit
    count plus the same fp32 statistics (Qwen3-0.6B within 1% of the count), within the 6% margin the estimate adds."""
    from model_utils.models.build import model_config
    from model_utils.models.memory import (EAGER_ACTIVATION_MARGIN, eager_layer_activation_bytes_per_token,
                                           layer_activation_bytes_per_token)

    records = REPO / "benchmarks/results/h100-2026-11-26-layer-activations.jsonl"
    lines = [json.loads(line) for line in records.read_text().splitlines()]
    measured = [line for line in lines if line.get("kind") == "per_layer"]
    assert {(line["model"], line["compile"]) for line in measured} == {
        (m, c) for m in ("qwen3-0.6b", "qwen3-4b", "qwen3-8b") for c in ("layers", "off")}
    for line in measured:
        config = model_config(line["model"])
        if line["compile"] == "layers":
            # to the byte: the allocator's 512-byte blocks spread over a batch's tokens
            assert line["bytes_per_token"] == pytest.approx(layer_activation_bytes_per_token(config), abs=1), line
        else:
            counted = eager_layer_activation_bytes_per_token(config)
            assert 0.99 * counted / EAGER_ACTIVATION_MARGIN <= line["bytes_per_token"] <= counted, line


def test_the_layer_counts_with_and_without_lora_equal_the_layers_measured_on_the_gpu():
    """One decoder layer of Llama 3.2 1B's dimensions (no query and key norms) and of Qwen3-1.7B at 2048 tokens, measured
    on one H100 by benchmarks/layer_activations.py, with LoRA rank 16 on the family's default layers, dropout 0.05 and
    0, and without: compiled, the count with the adapters' bytes exactly (a mask byte per adapter input element with
    dropout, 4 bytes per rank element); eager, at most 6% above the measurement, never below."""
    from model_utils.config.settings import LoraSettings
    from model_utils.models.build import model_config
    from model_utils.models.lora import adapter_activations, meta_model
    from model_utils.models.memory import eager_layer_activation_bytes_per_token, layer_activation_bytes_per_token

    records = REPO / "benchmarks/results/h100-2026-11-27-layer-activations.jsonl"
    lines = [json.loads(line) for line in records.read_text().splitlines()]
    measured = [line for line in lines if line.get("kind") == "per_layer"]
    assert {(line["model"], line["compile"], line["lora_dropout"]) for line in measured} == {
        ("llama-1b", "layers", 0.05), ("llama-1b", "layers", 0.0), ("llama-1b", "off", 0.05), ("llama-1b", "layers", None),
        ("llama-1b", "off", None), ("qwen3-1.7b", "layers", 0.05)}
    for line in measured:
        config = model_config(line["model"])
        adapters = None
        if line["lora_rank"]:
            settings = LoraSettings(rank=line["lora_rank"], dropout=line["lora_dropout"])
            adapters = adapter_activations(meta_model(config, settings), settings, config.num_hidden_layers)
        compiled = line["compile"] == "layers"
        added = adapters.bytes_per_token(compiled) if adapters else 0
        if compiled:
            assert line["bytes_per_token"] == pytest.approx(layer_activation_bytes_per_token(config) + added, abs=1), line
        else:
            counted = eager_layer_activation_bytes_per_token(config) + added
            assert line["bytes_per_token"] <= counted <= 1.06 * line["bytes_per_token"], line
    # the adapters of one Llama layer: q, k, v, gate, up read the hidden state, o the attention's output, down the MLP's
    config = model_config("llama-1b")
    settings = LoraSettings(rank=16)
    adapters = adapter_activations(meta_model(config, settings), settings, config.num_hidden_layers)
    assert (adapters.inputs, adapters.ranks, adapters.dropout) == (
        6 * config.hidden_size + config.intermediate_size, 7 * 16, True)


def test_gradients_count_in_the_peak_only_where_a_step_has_several_micro_batches(monkeypatch, session_cache,
                                                                                 tmp_path):
    """With one micro-batch a step, ZeRO-1/2 make their 16-bit gradients during the backward as the layers free their
    activations, after the peak: Qwen3-0.6B at micro-batch 8 on one H100 peaked at 39.6 GiB with one and at 40.7 with
    two (h100-2026-11-26.jsonl), its 596M parameters' gradients (1.1 GiB) apart. The accumulation each candidate
    micro-batch would get is the one the resolved batch has."""

    params = 596_049_920
    one = _estimate_gib("qwen3-0.6b", "ds_config.json --global_batch_tokens=32768", 8, H100, 1, {}, monkeypatch,
                        tmp_path)
    two = _estimate_gib("qwen3-0.6b", "ds_config.json --global_batch_tokens=65536", 8, H100, 1, {}, monkeypatch,
                        tmp_path)
    assert two - one == pytest.approx(2 * params / GIB, rel=0.01)
    for setup, micro, world in (("ds_config.json --global_batch_tokens=65536", 8, 1),
                                ("ds_config.json --global_batch_tokens=262144", 4, 2),
                                ("ds_config.json --gradient_accumulation_steps=3", 8, 1),
                                ("ds_config.json", "auto", 1)):
        plan = _plan("qwen3-0.6b", setup, micro, H100, world, {}, monkeypatch, tmp_path)
        assert plan.memory_model.batch.accumulation_at(plan.batch.micro) == plan.batch.accumulation, setup


def test_the_delayed_updates_prefetch_buffer_is_in_the_estimate(monkeypatch, session_cache, tmp_path):
    """--delayed_update_prefetch on keeps a GPU copy of each rank's 16-bit partition under ZeRO-1/2 (2 bytes per
    parameter over the data-parallel ranks); ZeRO-3 rewrites its partitions in place and has none."""
    params = 4.02e9  # Qwen3-4B
    delayed = "configs/zero2-offload.json --delayed_update_from_step=1"
    for world in (2, 1):
        on = _estimate_gib("qwen3-4b", f"{delayed} --delayed_update_prefetch=on", 2, H100, world, {}, monkeypatch,
                           tmp_path)
        off = _estimate_gib("qwen3-4b", f"{delayed} --delayed_update_prefetch=off", 2, H100, world, {}, monkeypatch,
                            tmp_path)
        assert on - off == pytest.approx(2 * params / world / GIB, rel=0.01), (world, on, off)
    # without the delayed update there is nothing to prefetch
    assert _estimate_gib("qwen3-4b", "configs/zero2-offload.json", 2, H100, 1, {}, monkeypatch, tmp_path) == off
    zero3 = "configs/zero3-offload.json --delayed_update_from_step=1"
    assert (_estimate_gib("qwen3-4b", f"{zero3} --delayed_update_prefetch=on", 2, H100, 1, {}, monkeypatch, tmp_path)
            == _estimate_gib("qwen3-4b", f"{zero3} --delayed_update_prefetch=off", 2, H100, 1, {}, monkeypatch,
                             tmp_path))


def test_the_automatic_prefetch_takes_only_memory_the_micro_batch_leaves(monkeypatch, session_cache, tmp_path):
    """--delayed_update_prefetch auto (the default) is decided after the automatic micro-batch, which it never
    shrinks: Qwen3-8B's 4 x 8 on each of two H200s leaves room for the buffer (half the model there), and so does 4 x 8
    on one H200 by the estimate; Qwen3-4B's 4 x 8 on one H100 does not (77 GiB with it), so it runs without. On, the
    micro-batch is chosen with the buffer: 2 there."""
    delayed = "configs/zero2-offload.json --delayed_update_from_step=1"
    q4b = _plan("qwen3-4b", f"{delayed} --global_batch_tokens=131072", "auto", H100, 1, {}, monkeypatch, tmp_path)
    assert (q4b.batch.micro, q4b.memory.delayed_prefetch) == (4, False), q4b.memory.delayed_prefetch_choice
    assert q4b.memory.delayed_prefetch_choice.startswith("auto: off")
    two = _plan("qwen3-8b", f"{delayed} --global_batch_tokens=262144", "auto", H200, 2, {}, monkeypatch, tmp_path)
    assert (two.batch.micro, two.memory.delayed_prefetch) == (4, True), two.memory.delayed_prefetch_choice
    assert two.memory.delayed_prefetch_choice.startswith("auto: on")
    forced = _plan("qwen3-4b", f"{delayed} --delayed_update_prefetch=on --global_batch_tokens=131072", "auto", H100,
                   1, {}, monkeypatch, tmp_path)
    assert (forced.batch.micro, forced.memory.delayed_prefetch, forced.memory.delayed_prefetch_choice) == (2, True, None)


def test_qwen3_4b_under_the_offload_preset_takes_its_fastest_micro_batch(monkeypatch, session_cache, tmp_path):
    """Qwen3-4B with configs/zero2-offload.json on one H100 ran fastest at 4 x 8 (18,022 against 16,556 tokens/s at
    2 x 16 with the prefetch; h100-2026-11-26.jsonl), with 70.0 GiB allocated and 76.5 reserved of 79.2, and the
    zero2-large journey runs it to its end. Its estimate, 69.6 GiB, fits the 90% auto fills: auto takes 4 and leaves
    out the prefetch buffer, which would not fit beside it."""
    delayed = "configs/zero2-offload.json --delayed_update_from_step=1 --global_batch_tokens=131072"
    auto = _plan("qwen3-4b", delayed, "auto", H100, 1, {}, monkeypatch, tmp_path)
    assert (auto.batch.micro, auto.batch.accumulation, auto.memory.delayed_prefetch) == (4, 8, False), auto.micro_batch_choice
    assert "auto: 4, ~69.6 GiB estimated" in auto.micro_batch_choice
    assert 0.85 * H100 < auto.memory.phases.peak[1] / GIB < 0.90 * H100


def test_offloaded_states_that_do_not_fit_the_node_are_refused(tmp_path, monkeypatch, session_cache):
    """Offload puts 16 bytes per parameter (fp32 master weights, Adam moments, fp32 gradients) in the node's memory:
    Qwen3-4B needs ~74 GiB (one H100 host measured 73.4), Qwen3-8B ~142 GiB, more than a 128 GiB node has, on two
    ranks half each. A run whose node lacks the room stops before building anything, naming the fix."""
    from model_utils.config.flags import parse_args
    from model_utils.models.memory import GIB, HOST_STATE_OVERHEAD, offload_host_bytes
    from model_utils.planning import plan as plan_module
    from model_utils.planning.preflight import check_plan

    q4b, q8b = 4_022_468_096, 8_190_735_360
    assert 72 < offload_host_bytes(q4b, 1, 1, 2, True, False, True) / GIB < 76
    assert 80 < offload_host_bytes(q4b, 1, 1, 2, True, False, False) / GIB < 86  # bf16 accumulation on the host: 83.9
    assert offload_host_bytes(q8b, 1, 1, 2, True, False, True) / GIB > 128
    assert offload_host_bytes(q8b, 2, 1, 2, True, False, True) / GIB < 80  # one of two nodes
    assert offload_host_bytes(q8b, 1, 1, 2, False, False, True) == 0
    # ZeRO-3 with parameters and optimizer offloaded adds its 16-bit parameters and its gradient accumulation buffer,
    # which DeepSpeed pins in host memory (one H100 host measured 90.6 GiB for Qwen3-4B)
    assert 88 < offload_host_bytes(q4b, 1, 1, 3, True, True, False) / GIB < 93
    assert 180 < offload_host_bytes(q8b, 2, 2, 3, True, True, False) / GIB < 190  # a host of two H200: 2 x 90.2
    fp32_buffer = offload_host_bytes(q4b, 1, 1, 3, True, True, True) - offload_host_bytes(q4b, 1, 1, 3, True, True, False)
    assert fp32_buffer == pytest.approx(2 * q4b * HOST_STATE_OVERHEAD)  # grad_accum_dtype fp32: 2 bytes more
    # A real plan on this CPU machine: the tiny model's states need little, a node with 100 MiB left has not that.
    cfg = parse_args(["--model", "tiny", "--ds_config", str(REPO / "configs" / "zero2-offload.json"),
                      "--dummy_data", "64", "--checkpoint_dir", str(tmp_path / "ckpt")])
    monkeypatch.setattr(plan_module, "host_memory_available", lambda: 100 * 2**20)
    report = check_plan(plan_module.make_plan(cfg, 1, on_training_hardware=True), check_data=False)
    [problem] = [p for p in report.problems if p.setting.startswith("zero_optimization.offload")]
    assert "host memory on this node, 0 GiB are available" in problem.message and "more GPUs or nodes" in problem.fix
    monkeypatch.setattr(plan_module, "host_memory_available", lambda: 64 * GIB)
    report = check_plan(plan_module.make_plan(cfg, 1, on_training_hardware=True), check_data=False)
    assert not [p for p in report.problems if p.setting.startswith("zero_optimization.offload")]
    assert any(line.startswith("host memory: ~1 GiB per node") for line in report.estimates), report.estimates


def test_a_resume_needs_host_memory_for_loading_its_checkpoint(tmp_path, monkeypatch, session_cache):
    """Loading a checkpoint with the optimizer offloaded holds about one fp32 copy of the parameters beside the
    offloaded states (Qwen3-4B on one H100 host, resuming against the run that saved it: 88.0 against 73.7 GiB under
    ZeRO-2, 105.2 against 90.9 under ZeRO-3 with the parameters offloaded too). A node with room for the states but not
    for that: a fresh start notes it, a resume is refused before the ranks load anything, naming --resume (or
    --resume_from_checkpoint); with room for both, neither."""
    from model_utils.config.flags import parse_args
    from model_utils.models.memory import GIB, offload_host_bytes, resume_host_bytes
    from model_utils.planning import plan as plan_module
    from model_utils.planning.preflight import check_plan

    q4b = 4_022_468_096
    zero2 = offload_host_bytes(q4b, 1, 1, 2, True, False, True) + resume_host_bytes(q4b, 1, 1, True)
    zero3 = offload_host_bytes(q4b, 1, 1, 3, True, True, False) + resume_host_bytes(q4b, 1, 1, True)
    assert 87 < zero2 / GIB < 90 and 104 < zero3 / GIB < 107, (zero2 / GIB, zero3 / GIB)
    assert resume_host_bytes(q4b, 2, 1, True) == resume_host_bytes(q4b, 1, 1, True) / 2  # one of two nodes
    assert resume_host_bytes(q4b, 1, 1, False) == 0  # nothing offloaded
    assert resume_host_bytes(q4b, 1, 1, True, gpu_optimizer_share=0.45) == 0  # a partial offload: not measured

    ckpt = tmp_path / "ckpt"
    cfg_args = ["--model", "tiny", "--ds_config", str(REPO / "configs" / "zero2-offload.json"), "--dummy_data", "64",
                "--checkpoint_dir", str(ckpt)]
    cfg = parse_args(cfg_args)
    monkeypatch.setattr(plan_module, "host_memory_available", lambda: 1e15)
    roomy = plan_module.make_plan(cfg, 1, on_training_hardware=True)
    assert roomy.memory.resume_host_bytes > 0
    between = roomy.memory.host_bytes + roomy.memory.resume_host_bytes / 2
    monkeypatch.setattr(plan_module, "host_memory_available", lambda: between)

    def report():
        return check_plan(plan_module.make_plan(cfg, 1, on_training_hardware=True), check_data=False)

    fresh = report()
    assert not [p for p in fresh.problems if p.setting == "--resume"], fresh.problems
    assert any("but not a resume of their checkpoint" in note for note in fresh.notes), fresh.notes
    assert any("while a resume loads a checkpoint" in line for line in fresh.estimates), fresh.estimates
    (ckpt / "step-00000010").mkdir(parents=True)
    (ckpt / "step-00000010" / "manifest.json").write_text(json.dumps({"step": 10, "world_size": 1, "files": {}}))
    resumed = report()
    [problem] = [p for p in resumed.problems if p.setting == "--resume"]
    assert "loading step-00000010 needs ~" in problem.message and "the checkpoint is intact" in problem.fix
    named = check_plan(plan_module.make_plan(parse_args([*cfg_args, "--resume_from_checkpoint",
                                                         str(ckpt / "step-00000010")]), 1, on_training_hardware=True),
                       check_data=False)
    assert [p.setting for p in named.problems if "loading step-00000010" in p.message] == ["--resume_from_checkpoint"]
    monkeypatch.setattr(plan_module, "host_memory_available", lambda: 1e15)
    assert not [p for p in report().problems if p.setting == "--resume"]

def test_a_partial_offload_counts_the_pinned_blocks_of_its_gpu_part(monkeypatch, session_cache):
    """ZeRO-3 with half of Qwen3-4B's optimizer offloaded ("ratio": 0.5): DeepSpeed creates the GPU half's fp32
    gradient buffers in pinned host memory and moves them to the GPU; PyTorch's pinned-memory cache keeps the blocks.
    One H100 host measured a peak of 63.9 GiB after two steps (8 GiB of them such freed pinned blocks, by PyTorch's
    host allocator statistics); without those 4 bytes per parameter of the GPU part the estimate would be 57 GiB. Not
    pinned (offload_optimizer.pin_memory false), they are not kept."""
    from model_utils.config.deepspeed import gpu_optimizer_share
    from model_utils.config.flags import parse_args
    from model_utils.models.memory import GIB, HOST_STATE_OVERHEAD
    from model_utils.planning import plan as plan_module

    monkeypatch.setenv("GPU_MEMORY_GIB", "79.2")

    def host_gib(pin_memory):
        config = json.loads((REPO / "configs" / "zero3-offload.json").read_text())
        config["zero_optimization"]["offload_optimizer"].update(ratio=0.5, pin_memory=pin_memory)
        path = Path(session_cache) / f"zero3-offload-half-{pin_memory}.json"
        path.write_text(json.dumps(config))
        cfg = parse_args(["--model", "qwen3-4b", "--ds_config", str(path), "--micro_batch_size", "2",
                          "--gradient_accumulation_steps", "2", "--dummy_data", "64", "--checkpoint_dir",
                          "/nonexistent/ckpt", "--no-export"])
        plan = plan_module.make_plan(cfg, 1, decides=False)
        return plan.memory.host_bytes / GIB, plan

    pinned, plan = host_gib(True)
    assert abs(pinned - 63.9) / 63.9 < 0.05, pinned
    unpinned, _ = host_gib(False)
    share = gpu_optimizer_share(plan.ds_config, plan.model.param_groups, 1)
    assert 0.4 < share < 0.6
    assert pinned - unpinned == pytest.approx(4 * share * plan.model.num_params * HOST_STATE_OVERHEAD / GIB)


def test_the_cheapest_fit_leaves_out_offloads_whose_host_part_does_not_fit_the_node():
    """Qwen3-8B on one H100 (79.2 GiB): by GPU memory alone the cheapest fix is ZeRO-2 with the optimizer offloaded,
    whose states need ~142 GiB of host memory. On a node with 124 GiB available it is left out (as is the full ZeRO-3
    offload); where the node is unknown (a login node) the fix names its host need."""
    from transformers import Qwen3Config

    from model_utils.models.memory import GIB, cheapest_fit

    q8b = Qwen3Config(vocab_size=151_936, hidden_size=4096, intermediate_size=12_288, num_hidden_layers=36,
                      num_attention_heads=32, num_key_value_heads=8, head_dim=128)
    args = (8_190_735_360, q8b, 1, 4096, 2, True, True, 8, 79.2, {"stage": 3}, False)
    unknown = cheapest_fit(*args)
    assert "configs/zero2-offload.json" in unknown and "of host memory per node" in unknown, unknown
    assert 135 < float(unknown.split("~")[2].split(" GiB")[0]) < 150, unknown
    small_node = cheapest_fit(*args, host_available=124 * GIB)
    assert "configs/" not in small_node and "with this node's memory" in small_node, small_node
    large_node = cheapest_fit(*args, host_available=512 * GIB)
    assert large_node == unknown


def test_the_cheapest_fit_of_a_lora_run_counts_its_frozen_weights_as_16_bit_only():
    """Qwen3-8B with LoRA (40M adapter parameters, the 8.19B others frozen) on one H100 at micro-batch 8 x 4096: its
    frozen weights take 2 bytes each, not full training's 16, so a smaller micro-batch fits without offload; counted as
    if every parameter trained, the fix would be to offload."""
    from transformers import Qwen3Config

    from model_utils.models.memory import AdapterActivations, cheapest_fit

    q8b = Qwen3Config(vocab_size=151_936, hidden_size=4096, intermediate_size=12_288, num_hidden_layers=36,
                      num_attention_heads=32, num_key_value_heads=8, head_dim=128)
    adapters = AdapterActivations(inputs=6 * 4096 + 12_288, ranks=7 * 16, dropout=True)
    args = (q8b, 1, 4096, 8, True, True, 8, 79.2, {"stage": 2, "reduce_bucket_size": 2e8}, True)
    lora = cheapest_fit(40_370_176, *args, adapters=adapters, frozen_params=8_190_735_360)
    assert lora.endswith("train_micro_batch_size_per_gpu 2 (--global_batch_tokens keeps the batch; or \"auto\")"), lora
    assert "configs/" in cheapest_fit(40_370_176 + 8_190_735_360, *args, adapters=adapters)


def test_frozen_weights_count_at_16_bits_where_zero_puts_them():
    """LoRA's frozen weights: 2 bytes each on every GPU under ZeRO-1/2, a rank's share under ZeRO-3, on the host (with
    the offload's overhead) where ZeRO-3 offloads the parameters; no gradient or optimizer state either way."""
    from model_utils.models.memory import GIB, HOST_STATE_OVERHEAD, model_state_bytes, offload_host_bytes

    frozen, world = 8 * 10**9, 4
    assert model_state_bytes(0, world, 2, False, False, True, frozen_params=frozen) == 2 * frozen
    assert model_state_bytes(0, world, 3, False, False, True, frozen_params=frozen) == 2 * frozen / world
    assert model_state_bytes(0, world, 3, True, True, True, frozen_params=frozen) == 0
    host = offload_host_bytes(0, world, 1, 3, True, True, False, frozen_params=frozen)
    assert host - 8 * GIB == pytest.approx(2 * frozen / world * HOST_STATE_OVERHEAD)
    assert offload_host_bytes(0, world, 1, 2, True, False, True, frozen_params=frozen) == 8 * GIB


def test_offloaded_states_over_the_node_get_a_partial_offload_that_fits(monkeypatch, session_cache):
    """Qwen3-8B with its optimizer offloaded on one H200 (139.8 GiB) whose node has 120 GiB free: the whole optimizer
    (~142 GiB) does not fit the host; the fix names the largest offload ratio whose host part fits 90% of it, with the
    parameters kept on the GPU (they fit there; offloaded, every micro-batch fetches them from the host), and that
    config's own plan fits the node and the GPU."""
    import re

    from model_utils.config.flags import parse_args
    from model_utils.models import speed
    from model_utils.models.memory import GIB
    from model_utils.planning import plan as plan_module
    from model_utils.planning.preflight import check_plan

    monkeypatch.setenv("GPU_MEMORY_GIB", "139.8")
    monkeypatch.setattr(speed, "liger_available", lambda: True)
    monkeypatch.setattr(plan_module, "host_memory_available", lambda: 120 * GIB)

    def planned(config_path):
        cfg = parse_args(["--model", "qwen3-8b", "--ds_config", str(config_path), "--global_batch_tokens", "131072",
                          "--dummy_data", "64", "--checkpoint_dir", "/nonexistent/ckpt", "--no-export"])
        plan = plan_module.make_plan(cfg, 1, decides=False)
        plan = dataclasses.replace(plan, hardware=dataclasses.replace(plan.hardware, host_available=120 * GIB))  # as a run's start on that node finds it
        return plan, check_plan(plan, check_data=False)

    plan, report = planned(REPO / "configs" / "zero2-offload.json")
    [problem] = [p for p in report.problems if p.setting.startswith("zero_optimization.offload")]
    assert "~142 GiB of host memory on this node, 120 GiB are available" in problem.message
    named = r'configs/zero3-offload.json with "offload_param": \{"device": "none"\} and "offload_optimizer": '
    ratio = float(re.search(named + r'\{"ratio": ([\d.]+)\}', problem.fix).group(1))
    assert 0 < ratio < 1

    def preset_with(ratio):
        config = json.loads((REPO / "configs" / "zero3-offload.json").read_text())
        config["zero_optimization"]["offload_optimizer"]["ratio"] = ratio
        config["zero_optimization"]["offload_param"]["device"] = "none"
        path = Path(session_cache) / f"zero3-offload-ratio-{ratio}.json"
        path.write_text(json.dumps(config))
        return planned(path)

    plan, report = preset_with(ratio)
    assert plan.memory.host_bytes <= 0.9 * 120 * GIB and not [p for p in report.problems if "offload" in p.setting]
    assert plan.memory.phases.peak[1] <= 0.9 * 139.8 * GIB and plan.batch.micro >= 1
    # ...and it is the largest: the named config with the next ratio up needs more than 90% of the node's memory
    plan, report = preset_with(round(ratio + 0.05, 2))
    assert plan.memory.host_bytes > 0.9 * 120 * GIB, plan.memory.host_bytes / GIB


def test_offloaded_accumulation_through_the_cpu_gets_the_gpu_buffer_named(monkeypatch, session_cache):
    """The seeds' ZeRO-2 + optimizer offload config accumulates gradients through the CPU: the preflight names the
    fp32 GPU buffer that avoids it, and its cost; the preset, which carries it, gets no such note."""
    from model_utils.config.flags import parse_args
    from model_utils.models import speed
    from model_utils.planning import plan as plan_module
    from model_utils.planning.preflight import check_plan

    monkeypatch.setenv("GPU_MEMORY_GIB", "79.2")
    monkeypatch.setattr(speed, "liger_available", lambda: True)
    seeds = json.loads((REPO / "configs" / "zero2-offload.json").read_text())
    seeds.pop("data_types")
    path = Path(session_cache) / "seeds-zero2-offload.json"
    path.write_text(json.dumps(seeds))

    def notes(config_path, tokens):
        cfg = parse_args(["--model", "qwen3-4b", "--ds_config", str(config_path), "--global_batch_tokens", str(tokens),
                          "--dummy_data", "64", "--checkpoint_dir", "/nonexistent/ckpt", "--no-export"])
        return [n for n in check_plan(plan_module.make_plan(cfg, 1, decides=False), check_data=False).notes
                if "grad_accum_dtype" in n]

    [note] = notes(path, 131072)
    assert "micro-batches' gradients to the CPU and back" in note and "~15.0 GiB more per GPU" in note, note
    assert not notes(REPO / "configs" / "zero2-offload.json", 131072)
    micro = plan_module.make_plan(parse_args(["--model", "qwen3-4b", "--ds_config", str(path), "--global_batch_tokens",
                                              "131072", "--dummy_data", "64", "--no-export"]), 1, decides=False).batch.micro
    assert not notes(path, micro * 4096)  # no accumulation: nothing goes back and forth


def test_a_small_micro_batch_under_parameter_offload_gets_the_larger_one_named(monkeypatch, session_cache):
    """ZeRO-3 with the parameters offloaded fetches them all from host memory for every micro-batch: Qwen3-4B at
    131,072 tokens per step on one H100 (79.2 GiB) with micro-batch 2 (x 16) gets the note naming 4 (x 8), which fits by
    the estimate; at 4, or with "auto", or under ZeRO-2 offload, there is none."""
    from model_utils.config.flags import parse_args
    from model_utils.models import speed
    from model_utils.planning import plan as plan_module
    from model_utils.planning.preflight import check_plan

    monkeypatch.setenv("GPU_MEMORY_GIB", "79.2")
    monkeypatch.setattr(speed, "liger_available", lambda: True)

    def notes(preset, micro):
        cfg = parse_args(["--model", "qwen3-4b", "--ds_config", str(REPO / "configs" / preset), "--global_batch_tokens",
                          "131072", "--micro_batch_size", micro, "--dummy_data", "64", "--checkpoint_dir",
                          "/nonexistent/ckpt", "--no-export"])
        return [n for n in check_plan(plan_module.make_plan(cfg, 1, decides=False), check_data=False).notes
                if "parameters offloaded fetches" in n]

    [note] = notes("zero3-offload.json", "2")
    assert "16 times per step at micro-batch 2: micro-batch 4 (x 8) fits" in note and "~15 GiB per rank" in note, note
    assert not notes("zero3-offload.json", "4") and not notes("zero3-offload.json", "auto")
    assert not notes("zero2-offload.json", "1")


def test_parameter_offload_without_checkpointing_gets_the_checkpointed_micro_batch_named(monkeypatch, session_cache):
    """ZeRO-3 with the parameters offloaded fetches them for every micro-batch: Qwen3-4B at 131,072 tokens per step on
    one H100 (79.2 GiB) takes micro-batch 4 (x 8) without checkpointing, and the note names what "auto" takes with
    --gradient_checkpointing, 16 (x 2), with that plan's own estimate; with checkpointing, or without parameter offload
    (ZeRO-3 with everything on the GPU), there is none."""

    from model_utils.config.flags import parse_args
    from model_utils.models import speed
    from model_utils.planning import memory_checks
    from model_utils.planning import plan as plan_module
    from model_utils.planning.preflight import check_plan

    monkeypatch.setenv("GPU_MEMORY_GIB", "79.2")
    monkeypatch.setattr(speed, "liger_available", lambda: True)

    def plan_for(preset, *flags):
        cfg = parse_args(["--model", "qwen3-4b", "--ds_config", str(REPO / "configs" / preset), "--global_batch_tokens",
                          "131072", "--dummy_data", "64", "--checkpoint_dir", "/nonexistent/ckpt", "--no-export", *flags])
        return plan_module.make_plan(cfg, 1, decides=False)

    def notes(plan):
        return [n for n in check_plan(plan, check_data=False).notes if n.startswith("with --gradient_checkpointing")]

    plan = plan_for("zero3-offload.json")
    checkpointed = plan_for("zero3-offload.json", "--gradient_checkpointing")
    assert (plan.batch.micro, checkpointed.batch.micro) == (4, 16)
    [note] = notes(plan)
    assert (f"micro-batch 16 (x 2) fits by the estimate (~{checkpointed.memory.phases.peak[1] / GIB:.1f} GiB) and fetches the "
            "offloaded parameters 2 times per step instead of 8") in note, note
    assert not notes(checkpointed)
    on_gpu = plan_for("zero3-offload.json")
    on_gpu.ds_config["zero_optimization"]["offload_param"]["device"] = "none"
    assert not notes(on_gpu)
    assert memory_checks.checkpointed_micro_that_fits(without_gpu_size(plan)) is None


def without_gpu_size(plan):
    """The plan as a machine that knows no GPU size would have made it."""
    hardware = dataclasses.replace(plan.hardware, gpu_memory_gib=None)
    return dataclasses.replace(plan, hardware=hardware,
                               memory_model=dataclasses.replace(plan.memory_model, hardware=hardware))


def test_automatic_micro_batch_fills_the_gpu_by_the_estimate(tmp_path, session_cache, monkeypatch, capsys,
                                                             ample_disk):
    """The presets' micro-batch is "auto": the plan picks the largest whose whole run fits 90% of the GPU (stand-in
    sizes: no GPU here), within the global batch, and the preflight prints the choice and its estimate."""
    import re

    from model_utils.models import speed

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(speed, "liger_available", lambda: False)  # the GPU nodes' fused loss, assumed
    base = ["--model", "qwen3-0.6b", "--dummy_data", "64", "--checkpoint_dir", str(tmp_path / "ckpt")]

    def chosen(args, gib):
        proc, _ = preflight_in_process([*base, *args], {"GPU_MEMORY_GIB": str(gib)}, monkeypatch, capsys)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        line = re.search(r"micro-batch: auto: (\d+), ~([\d.]+) GiB estimated", proc.stdout)
        batch = re.search(r"batch: micro (\d+) x grad_acc (\d+)", proc.stdout)
        assert line and int(line.group(1)) == int(batch.group(1)), proc.stdout
        return int(batch.group(1)), int(batch.group(2)), float(line.group(2))

    micro, accumulation, estimate = chosen([], 79.2)  # one H100 (80 GB): the cap, 16 blocks of 4096 tokens
    assert (micro, accumulation) == (16, 1) and estimate <= 0.9 * 79.2
    micro, _, estimate = chosen([], 40)
    assert 6 <= micro <= 8 and estimate <= 36
    # 131,072 tokens per step (32 blocks) on a 40 GiB GPU: a micro-batch that divides 32, accumulation derived.
    micro, accumulation, _ = chosen(["--global_batch_tokens", "131072"], 40)
    assert micro * accumulation == 32 and micro in (4, 8)
    # An explicit micro-batch is the user's: nothing is chosen.
    proc, _ = preflight_in_process([*base, "--micro_batch_size", "2"], {"GPU_MEMORY_GIB": "80"}, monkeypatch, capsys)
    assert "batch: micro 2 x grad_acc 1" in proc.stdout and "micro-batch: auto" not in proc.stdout


def test_problems_of_all_ranks_merge_once_each_with_the_rank_that_found_them():
    from model_utils.core.problems import Problem
    from model_utils.planning.preflight import merge_rank_problems

    shared = Problem("--model", "x", "unknown model", "pick a preset")
    disk = Problem("--checkpoint_dir", "/ckpt", "only 3 GiB free", "free space")
    merged = merge_rank_problems([("node1", [shared]), ("node1", [shared]), ("node2", [shared, disk]),
                                  ("node2", [disk])])
    assert [str(p) for p in merged] == [str(shared), str(Problem(disk.setting, disk.value,
                                                                   "only 3 GiB free (rank 2 on node2)", disk.fix))]
    assert merge_rank_problems([("node1", []), ("node2", [])]) == []


def test_only_the_deciding_rank_reads_checkpoints_and_resolves_the_data(tmp_path):
    """A run's ranks other than 0 leave the checkpoint scan and the data source to rank 0: no resume point, no data
    source and no checkpoint moved or named by them; the rest of the plan is the same."""
    from model_utils.config.flags import parse_args
    from model_utils.planning.plan import make_plan

    ckpt = tmp_path / "ckpt"
    (ckpt / "step-00000004").mkdir(parents=True)  # no manifest: incomplete
    data = tmp_path / "docs.txt"
    data.write_text("one document\n" * 50)
    cfg = parse_args(["--model", "tiny", "--checkpoint_dir", str(ckpt), "--dataset", str(data)])
    other = make_plan(cfg, 1, on_training_hardware=True, decides=False, move_incomplete=False)
    assert (ckpt / "step-00000004").is_dir() and not any("step-00000004" in note for note in other.notes)
    deciding = make_plan(cfg, 1, on_training_hardware=True, move_incomplete=True)
    assert deciding.incomplete_moved[0].startswith("step-00000004 -> incomplete/step-00000004 (")
    assert (ckpt / "incomplete" / "step-00000004").is_dir() and not (ckpt / "step-00000004").exists()
    assert deciding.resume is None and not deciding.problems
    assert deciding.data_source.files == [str(data)] and other.data_source is None and other.resume is None
    assert other.ds_config == deciding.ds_config and other.batch == deciding.batch


@pytest.fixture
def ample_disk(monkeypatch):
    """The checkpoints' disk check reports a petabyte free, for tests of other checks that plan full-size models'
    checkpoints (4 x 8 GiB for Qwen3-0.6B) in a temporary directory: their outcome does not depend on this disk."""
    import shutil
    from collections import namedtuple

    from model_utils.planning import preflight as preflight_module

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(preflight_module.shutil, "disk_usage", lambda path: usage(2**50, 0, 2**50))
    assert shutil.disk_usage is preflight_module.shutil.disk_usage


def test_memory_estimate_covers_evaluation_export_and_generation(tmp_path, session_cache, monkeypatch, capsys,
                                                            ample_disk):
    """Qwen3-8B under ZeRO-3 on 8 GPUs of 24 GiB (a stand-in size: no GPU here) trains, evaluates and exports within
    them, but the end-of-run sample loads the whole exported model beside the engine on rank 0: refused, naming
    --generate_prompt and the fix. At Qwen3-0.6B and micro-batch 16 the training step is the peak; evaluation, whose
    loss never holds the batch's logits, needs a fraction of it."""
    import re

    monkeypatch.chdir(tmp_path)
    base = ["--model", "qwen3-8b", "--ds_config", str(REPO / "configs" / "zero3.json"), "--micro_batch_size", "1",
            "--gradient_checkpointing", "--dummy_data", "64", "--checkpoint_dir", str(tmp_path / "ckpt")]
    env = {"GPU_MEMORY_GIB": "24"}
    ok, _ = preflight_in_process(base, {**env, "WORLD_SIZE": "8"}, monkeypatch, capsys)
    monkeypatch.setenv("WORLD_SIZE", "8")
    assert ok.returncode == 0, ok.stdout
    bad, _ = preflight_in_process([*base, "--generate_prompt", "Hello"], env, monkeypatch, capsys)
    assert bad.returncode == 2, bad.stdout
    assert "--generate_prompt = Hello: loading the exported model" in bad.stdout
    assert "python -m model_utils.generate" in bad.stdout
    small, _ = preflight_in_process(["--model", "qwen3-0.6b", "--micro_batch_size", "16", "--dummy_data", "64",
                                     "--checkpoint_dir", str(tmp_path / "c2")], {"GPU_MEMORY_GIB": "80"},
                                    monkeypatch, capsys)
    line = re.search(r"memory: ~([\d.]+) GiB per GPU estimated, at its peak in (\w+) \(train step ([\d.]+).*"
                     r"evaluation ([\d.]+); export ([\d.]+)", small.stdout)
    assert line, small.stdout
    total, phase, train, evaluation, export = line.groups()
    assert phase == "train" and float(total) == float(train) and float(evaluation) < float(train) / 3


def test_config_checks_run_without_torch(tmp_path):
    """A login node with a bare Python: --help and --preflight's configuration checks need no torch, DeepSpeed or
    transformers; the report says what it could not check."""
    venv = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "WORLD_SIZE")}
    assert subprocess.run([str(python), "-c", "import torch"], capture_output=True).returncode != 0
    help_ = subprocess.run([str(python), str(TRAINER), "--help"], capture_output=True, text=True, env=env)
    assert help_.returncode == 0 and "--deepspeed_config" in help_.stdout, help_.stderr
    ok = subprocess.run([str(python), str(TRAINER), "--preflight", "--max_steps", "40"], capture_output=True,
                        text=True, env=env, cwd=tmp_path)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "batch: micro 8 x grad_acc 1 x world 1" in ok.stdout and "not checked:" in ok.stdout
    bad_config = tmp_path / "ds.json"
    bad_config.write_text(json.dumps(dict(SHIPPED, train_batch_size=12, train_micro_batch_size_per_gpu=8)))
    bad = subprocess.run([str(python), str(TRAINER), "--preflight", "--ds_config", str(bad_config), "--max_steps", "0"],
                         capture_output=True, text=True, env=env, cwd=tmp_path)
    assert bad.returncode == 2 and "Traceback" not in bad.stdout + bad.stderr
    assert "train_batch_size = 12: is not a multiple of micro-batch 8 x world size 1" in bad.stdout
    assert "--max_steps = 0" in bad.stdout
    (tmp_path / "run.yaml").write_text("max_steps: 40\n")  # a config file needs pyyaml, which is all it needs
    no_yaml = subprocess.run([str(python), str(TRAINER), "--preflight", "--config", "run.yaml"], capture_output=True,
                             text=True, env=env, cwd=tmp_path)
    assert no_yaml.returncode == 2 and "--config = run.yaml: needs pyyaml" in no_yaml.stderr, no_yaml.stderr


@pytest.mark.parametrize("args, on_disk", [
    (["--checkpoint_freq", "0"], 1),  # the last step's save only
    (["--checkpoint_freq", "0", "--checkpoint_minutes", "30", "--keep_last_checkpoints", "2"], 3),  # by the clock
    (["--checkpoint_freq", "10", "--keep_last_checkpoints", "3"], 4),  # 3 kept + the one being written
])
def test_disk_need_counts_every_checkpoint_that_can_exist_at_once(args, on_disk, tmp_path, session_cache, monkeypatch,
                                                                  capsys):
    monkeypatch.chdir(tmp_path)
    proc, _ = preflight_in_process([*args, "--checkpoint_dir", str(tmp_path / "c")], {}, monkeypatch, capsys)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f" each, {on_disk} on disk at most;" in proc.stdout


def test_a_resumed_run_needs_room_only_for_the_checkpoints_it_adds(tmp_path, session_cache, monkeypatch, capsys):
    """The complete checkpoints a run resumes beside already take their disk: with 3 kept and 3 there, the run needs
    room for the one being written, not for four (which refused the resume of a run that had been saving fine). Where
    the last step's checkpoint alone does not fit, the problem names --checkpoint_dir: keeping fewer would not help."""
    import collections

    from model_utils.planning import preflight

    monkeypatch.chdir(tmp_path)
    ckpt_dir = tmp_path / "c"
    args = ["--checkpoint_dir", str(ckpt_dir), "--checkpoint_freq", "10", "--keep_last_checkpoints", "3"]
    free = {"bytes": 1e15}
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(preflight.shutil, "disk_usage", lambda path: usage(2e15, 0, free["bytes"]))
    roomy, _ = preflight_in_process(args, {}, monkeypatch, capsys)
    assert roomy.returncode == 0, roomy.stdout + roomy.stderr
    each = float(roomy.stdout.split("checkpoints: ~")[1].split(" GiB each")[0]) * GIB
    free["bytes"] = 1.5 * each  # one more fits, four do not

    fresh, _ = preflight_in_process(args, {}, monkeypatch, capsys)
    assert fresh.returncode == 2 and "  - --keep_last_checkpoints = 3: 4 more checkpoint(s) need" in fresh.stdout, \
        fresh.stdout
    for step in (10, 20, 30):  # complete: a manifest whose files (none) are all there
        (ckpt_dir / f"step-{step:08d}").mkdir(parents=True)
        (ckpt_dir / f"step-{step:08d}" / "manifest.json").write_text(
            json.dumps({"step": step, "world_size": 1, "files": {}}))
    (ckpt_dir / "step-00000040").mkdir()  # incomplete (no manifest): not counted
    resumed, _ = preflight_in_process(args, {}, monkeypatch, capsys)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert " each, 4 on disk at most (3 there already);" in resumed.stdout, resumed.stdout

    free["bytes"] = 0.5 * each
    final_only, _ = preflight_in_process([*args, "--checkpoint_freq", "0"], {}, monkeypatch, capsys)
    assert final_only.returncode == 2, final_only.stdout
    assert f"  - --checkpoint_dir = {ckpt_dir}: 1 more checkpoint(s) need" in final_only.stdout, final_only.stdout
    assert "free space there or use another --checkpoint_dir" in final_only.stdout

def test_the_shortest_save_interval_comes_from_the_disks_write_rate(tmp_path, session_cache, monkeypatch, capsys):
    """Periodic saves: the preflight writes (and fsyncs, then removes) a probe file where the checkpoints go and states
    how long a checkpoint takes to write at that rate, the shortest save interval that does not wait; a
    --checkpoint_minutes shorter than that gets a note."""
    from model_utils.config.settings import TrainConfig
    from model_utils.planning import preflight
    from model_utils.planning.report import Report

    rate = preflight.disk_write_rate(tmp_path)
    assert rate > 0 and not list(tmp_path.glob(".dslm-write-probe-*"))
    report = Report()
    monkeypatch.setattr(preflight, "disk_write_rate", lambda directory: 1e8)  # 100 MB/s
    preflight._state_the_shortest_save_interval(TrainConfig.from_flags(checkpoint_minutes=2.0), 3e10, tmp_path, report)
    assert report.lines == [f"checkpoint disk: {tmp_path} takes 100 MB/s from one writer (fsynced): a checkpoint is "
                            "written in the background in up to ~300 s (less where the ranks' writes add up), the "
                            "shortest interval between saves that does not wait for the previous one's writes"]
    assert report.notes == ["--checkpoint_minutes 2 is shorter than a checkpoint's write here (~300 s): each save "
                            "will wait for the previous one; save less often"]
    monkeypatch.undo()
    monkeypatch.chdir(tmp_path)
    measured, _ = preflight_in_process(["--checkpoint_dir", str(tmp_path / "c"), "--checkpoint_freq", "10"], {},
                                       monkeypatch, capsys)
    assert measured.returncode == 0 and f"checkpoint disk: {tmp_path} takes " in measured.stdout, measured.stdout


def test_a_caller_that_never_saves_skips_the_disk_check(tmp_path, monkeypatch):
    """The benchmark never saves: check_plan(check_disk=False), which train_deepspeed.setup(saves=False) passes, has
    no checkpoint line and no disk problem where the run's checkpoints would not fit any disk (10,000 of Qwen3-0.6B's)."""
    from model_utils.config.flags import parse_args
    from model_utils.planning.plan import make_plan
    from model_utils.planning.preflight import check_plan

    monkeypatch.setenv("GPU_MEMORY_GIB", "79.2")
    cfg = parse_args(["--model", "qwen3-0.6b", "--dummy_data", "64",
                      "--max_steps", "10000", "--checkpoint_freq", "1", "--keep_last_checkpoints", "0",
                      "--checkpoint_dir", str(tmp_path / "c"), "--no-export"])
    plan = make_plan(cfg, 1, decides=False)
    saving = check_plan(plan, check_data=False)
    assert [p.setting for p in saving.problems] == ["--keep_last_checkpoints"], saving.problems
    never = check_plan(plan, check_data=False, check_disk=False)
    assert never.problems == [] and not any(line.startswith("checkpoints:") for line in never.estimates)
    # A run's ranks but the first check the disk without writing the probe: one probe per job on the shared disk.
    assert any(line.startswith("checkpoint disk:") for line in saving.estimates)
    unprobed = check_plan(plan, check_data=False, measure_disk=False)
    assert [p.setting for p in unprobed.problems] == ["--keep_last_checkpoints"]
    assert not any(line.startswith("checkpoint disk:") for line in unprobed.estimates)


def test_background_checkpoint_writes_need_room_for_a_host_copy(tmp_path, session_cache, monkeypatch, capsys):
    """--background_checkpoint (the default) holds a copy of the node's share of a checkpoint in host memory: a run's
    start (on the node that holds it) falls back to synchronous writes where the copy would not fit; the preflight on a
    login node, whose memory says nothing of the GPU nodes', says the rule."""
    from model_utils.config.settings import TrainConfig
    from model_utils.planning import plan as plan_module

    monkeypatch.chdir(tmp_path)
    args = ["--checkpoint_dir", str(tmp_path / "c")]
    login, _ = preflight_in_process(args, {}, monkeypatch, capsys)
    assert ("checkpoint writes: in the background where a GPU node's host copy (~0.0 GiB) fits in 3/4 of its free "
            "memory, else synchronous: decided when the run starts") in login.stdout, login.stdout
    off, _ = preflight_in_process([*args, "--no-background_checkpoint"], {}, monkeypatch, capsys)
    assert "checkpoint writes: synchronous (--no-background_checkpoint)" in off.stdout
    cfg = TrainConfig.from_flags(checkpoint_dir=str(tmp_path / "c"))
    monkeypatch.setattr(plan_module, "host_memory_available", lambda: 1e6)  # 1 MB left on this node
    tight = plan_module.make_plan(cfg, 1, on_training_hardware=True)
    assert tight.checkpoints.background is False
    assert tight.checkpoints.description.startswith("synchronous: the host copy (~0.0 GiB per node) does not fit in 3/4 of "
                                              "the 0 GiB available"), tight.checkpoints.description
    monkeypatch.setattr(plan_module, "host_memory_available", lambda: 64e9)
    roomy = plan_module.make_plan(cfg, 1, on_training_hardware=True)
    assert roomy.checkpoints.background and roomy.checkpoints.description.startswith("in the background, from a host copy")


def test_the_offload_update_is_estimated_and_the_delay_named(monkeypatch, session_cache, tmp_path):
    """ZeRO with the optimizer offloaded: the preflight states how long each step's host update takes for the rank's
    offloaded share of the parameters (the H100 host's measured rate) and names --delayed_update_from_step; with the
    flag it says from which step the update runs beside the next one (under ZeRO-3 all but the conversion to 16 bits).
    Configs without an offloaded optimizer get no such line."""
    from model_utils.config.flags import parse_args
    from model_utils.models import speed
    from model_utils.planning import plan as plan_module
    from model_utils.planning.preflight import check_plan

    monkeypatch.setenv("GPU_MEMORY_GIB", "79.2")
    monkeypatch.setattr(speed, "liger_available", lambda: True)

    def update_lines(config, world=1, *extra):
        cfg = parse_args(["--model", "qwen3-4b", "--ds_config", str(REPO / config), "--global_batch_tokens", "131072",
                          "--dummy_data", "64", "--checkpoint_dir", "/nonexistent/ckpt", "--no-export", *extra])
        report = check_plan(plan_module.make_plan(cfg, world, decides=False), check_data=False)
        return [line for line in report.estimates if line.startswith("offload update:")]

    [line] = update_lines("configs/zero2-offload.json")
    assert "~1.5 s per step on the host for each rank's 4.02B parameters" in line
    assert "the GPU waits for it: --delayed_update_from_step S" in line
    [line] = update_lines("configs/zero2-offload.json", 2)
    assert "~0.7 s per step" in line and "2.01B parameters" in line
    [line] = update_lines("configs/zero2-offload.json", 1, "--delayed_update_from_step", "20")
    assert "from step 20 on it runs beside the next step (" in line
    # One micro-batch per step (8,192 tokens at micro-batch 2): only its forward runs beside the update.
    cfg_one = ["--delayed_update_from_step", "20", "--micro_batch_size", "2", "--global_batch_tokens", "8192"]
    [line] = update_lines("configs/zero2-offload.json", 1, *cfg_one)
    assert "beside the next step's forward only" in line and "gradient accumulation" in line
    [line] = update_lines("configs/zero3-offload.json", 1, "--delayed_update_from_step", "20")
    assert "~1.5 s per step" in line and "from step 20 on it runs beside the next step" in line
    assert "all but the conversion to 16 bits (~0.3 s), which ZeRO-3 keeps at the step's boundary" in line
    partial = json.loads((REPO / "configs" / "zero3-offload.json").read_text())
    partial["zero_optimization"]["offload_optimizer"]["ratio"] = 0.5
    (tmp_path / "partial.json").write_text(json.dumps(partial))
    [line] = update_lines(tmp_path / "partial.json")
    assert "~0.7 s per step" in line and "2.01B parameters (the offloaded 0.5 of them)" in line
    assert update_lines("ds_config.json") == [] and update_lines("configs/zero3.json") == []


def test_parameters_offloaded_where_zero2_fits_name_the_zero2_preset(monkeypatch):
    """ZeRO-3 with the parameters offloaded fetches them for every micro-batch: where configs/zero2-offload.json's
    setup fits the GPU (Qwen3-4B on an 80 GB GPU), the preflight names it with the micro-batch its "auto" takes and its
    estimate; where only ZeRO-3 fits (a 24 GiB GPU), it says nothing."""
    from model_utils.config.flags import parse_args
    from model_utils.planning.plan import make_plan
    from model_utils.planning.preflight import check_plan

    def plan_for(config):
        cfg = parse_args(["--model", "qwen3-4b", "--ds_config", str(REPO / config), "--global_batch_tokens", "131072",
                          "--dummy_data", "64", "--checkpoint_dir", "/nonexistent/ckpt", "--no-export"])
        return make_plan(cfg, 1, decides=False)

    def notes(config):
        return [n for n in check_plan(plan_for(config), check_data=False).notes if "configs/zero2-offload.json (" in n]

    monkeypatch.setenv("GPU_MEMORY_GIB", "79.2")
    zero2 = plan_for("configs/zero2-offload.json")
    [note] = notes("configs/zero3-offload.json")
    assert f"fits at micro-batch {zero2.batch.micro} by the estimate (~{zero2.memory.phases.peak[1] / GIB:.1f} GiB)" in note
    assert notes("configs/zero2-offload.json") == [] and notes("configs/zero3.json") == []
    monkeypatch.setenv("GPU_MEMORY_GIB", "24")
    assert notes("configs/zero3-offload.json") == []


def test_a_single_openmp_thread_under_an_offloaded_optimizer_is_named(monkeypatch):
    """OMP_NUM_THREADS=1, torchrun's default for several processes per node, leaves the CPU optimizer update one core
    per rank: the preflight says so with the fix; unset, or with the optimizer on the GPU, it says nothing."""
    from model_utils.config.flags import parse_args
    from model_utils.planning.plan import make_plan
    from model_utils.planning.preflight import check_plan

    monkeypatch.setenv("GPU_MEMORY_GIB", "79.2")

    def notes(config):
        cfg = parse_args(["--model", "qwen3-0.6b", "--ds_config", str(REPO / config), "--dummy_data", "64",
                          "--checkpoint_dir", "/nonexistent/ckpt", "--no-export"])
        return [n for n in check_plan(make_plan(cfg, 2, decides=False), check_data=False).notes
                if "OMP_NUM_THREADS" in n]

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    [note] = notes("configs/zero2-offload.json")
    assert "one core per rank" in note and "unset it" in note
    assert notes("ds_config.json") == []
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert notes("configs/zero2-offload.json") == []
