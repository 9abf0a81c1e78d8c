"""The other paths the seed READMEs promise: fine-tuning a pretrained model, dummy data, the distributed sanity
check, and the export/generate commands. Real DeepSpeed runs on 2 CPU ranks."""

from __future__ import annotations

import math
import sys

import numpy as np
import pytest
import preloaded
from conftest import FAST_ARGS, REPO, SRC, assert_ok, run_trainer


@pytest.fixture(scope="module")
def pretrained(session_cache, tmp_path_factory):
    """A small 'pretrained' model the test makes itself: 30 steps of the tiny preset, exported to HF format."""
    root = tmp_path_factory.mktemp("pretrained")
    run = run_trainer(root / "ckpt", ["--seq_len", "128", "--micro_batch_size", "4", "--max_steps", "30",
                                      "--log_interval", "10", "--eval_interval", "0", "--checkpoint_freq", "0", "--learning_rate", "2e-3",
                                      "--export_dir", str(root / "model")])
    assert_ok(run)
    return root / "model"


def _first_step_loss_of(model_dir, seq_len, micro, world, seed):
    """The mean loss the pretrained model gives on exactly the blocks that step 1 of the fine-tuning run reads."""
    import torch
    from transformers import AutoModelForCausalLM

    from model_utils.config.settings import TrainConfig
    from model_utils.data.blocks import BlockOrder, DataPosition
    from model_utils.data.pipeline import open_packed
    from model_utils.data.sources import resolve_source
    from model_utils.data.tokenizer import load_tokenizer
    from model_utils.data.tokens import cache_dir_for

    cfg = TrainConfig.from_flags(model=str(model_dir), seq_len=seq_len, seed=seed).data
    tokenizer = load_tokenizer(str(model_dir))
    data = open_packed(cfg, cache_dir_for(cfg, resolve_source(cfg), tokenizer), seq_len)
    order = BlockOrder(data.train_ids, seed, world, micro)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    losses = []
    with torch.no_grad():
        for rank in range(world):
            batch = torch.from_numpy(data.train.batch(order.rank_indices(DataPosition(), rank)))
            inputs, targets = batch[:, :-1].contiguous(), batch[:, 1:].contiguous()
            losses.append(model(input_ids=inputs, labels=targets, shift_labels=targets).loss.item())
    return float(np.mean(losses))


@pytest.mark.parametrize("config, gpu_gib", [("ds_config.json", None), ("configs/zero3.json", None),
                                             ("configs/zero3.json", "80")])
def test_finetuning_starts_at_the_pretrained_models_loss(pretrained, config, gpu_gib, tmp_path):
    """Under ZeRO-3 the model is built partitioned (HfDeepSpeedConfig -> zero.Init) and from_pretrained fills it; also
    with every parameter kept whole, as "auto" persistence chooses where a GPU size is known (GPU_MEMORY_GIB: the one
    stand-in, no GPU here) and the whole model fits."""
    run = run_trainer(tmp_path / "ckpt", [*FAST_ARGS, "--model", str(pretrained), "--dataset", "embedded", "--seq_len", "128",
                                          "--max_steps", "3", "--ds_config", config, "--seed", "5",
                                          "--export_dir", str(tmp_path / "finetuned")],
                      env={"GPU_MEMORY_GIB": gpu_gib} if gpu_gib else None)
    assert_ok(run)
    assert ("ZeRO-3 keeps every parameter whole" in run.output) == bool(gpu_gib)
    first = run.train_records()[0]
    assert first["step"] == 1
    expected = _first_step_loss_of(pretrained, 128, 2, 2, 5)
    assert first["loss"] == pytest.approx(expected, abs=1e-4)  # the pretrained weights, not a fresh init
    assert expected < math.log(8192) - 1.0
    assert (tmp_path / "finetuned" / "model.safetensors").exists()


def test_dummy_data_needs_no_dataset(tmp_path, session_cache):
    run = run_trainer(tmp_path / "ckpt", [*FAST_ARGS, "--dummy_data", "64", "--max_steps", "3", "--no-export"])
    assert_ok(run)
    assert "dummy data: 64 random blocks" in run.output
    # Random tokens: nothing to learn, the loss sits near ln(vocabulary).
    assert all(abs(r["loss"] - math.log(8192)) < 0.6 for r in run.train_records())


def test_sanity_check_all_reduces_and_reports_bandwidth(tmp_path):
    run = run_trainer(tmp_path / "ckpt", ["--sanity_check"])
    assert_ok(run)
    assert "sanity: 2 ranks on 1 node(s)" in run.output and "backend gloo" in run.output
    assert "sanity: all sums correct" in run.output
    rows = [line for line in run.output.splitlines() if line.strip().endswith(" ok")]
    assert len(rows) == 4  # one per message size, each verified
    assert "sanity" not in run.outputs[1]  # only rank 0 prints
    assert not (tmp_path / "ckpt").exists()  # nothing trained, nothing written


def test_export_and_generate_commands(pretrained, tmp_path):
    env_path = {"PYTHONPATH": str(SRC)}
    import os

    env = dict(os.environ, **env_path)
    gen = preloaded.run([sys.executable, "-m", "model_utils.generate", "--model", str(pretrained), "--prompt",
                         "Return the", "--max_new_tokens", "12"], capture_output=True, text=True, env=env, cwd=REPO,
                        timeout=300)
    assert gen.returncode == 0, gen.stderr
    text = gen.stdout.strip().splitlines()[-1]
    assert text.startswith("Return the") and len(text) > len("Return the")
    ckpt = pretrained.parent / "ckpt"
    export = preloaded.run([sys.executable, "-m", "model_utils.export", str(ckpt), "--output", str(tmp_path / "out")],
                           capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert export.returncode == 0, export.stderr
    assert (tmp_path / "out" / "model.safetensors").exists() and (tmp_path / "out" / "tokenizer.json").exists()
    missing = preloaded.run([sys.executable, "-m", "model_utils.export", str(tmp_path / "nothing-here")],
                            capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert missing.returncode == 2 and "error:" in missing.stderr and "Traceback" not in missing.stderr


PATTERN = "one two three four five six seven eight nine ten"


def test_generation_continues_the_pattern_the_model_was_trained_on(session_cache, tmp_path):
    """A model trained on one sentence, each line of its corpus a document, continues the sentence's first words with
    the rest: the sample the trainer prints after the export (greedy) is the sentence. Weights that did not train, or
    a generation that lost the prompt or the trained weights, give other words."""
    corpus = tmp_path / "pattern.txt"
    corpus.write_text(f"{PATTERN}\n" * 300)
    run = run_trainer(tmp_path / "ckpt", ["--dataset", str(corpus), "--seq_len", "64", "--micro_batch_size", "4",
                                          "--max_steps", "40", "--learning_rate", "3e-3", "--warmup_steps", "2",
                                          "--log_interval", "10", "--eval_interval", "0", "--eval_iters", "1",
                                          "--checkpoint_freq", "0", "--generate_prompt", "one two three four"])
    assert_ok(run)
    sample = run.output.split("sample: ", 1)[1].splitlines()[0]
    assert sample.startswith(PATTERN), sample
