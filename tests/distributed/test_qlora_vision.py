"""QLoRA of a vision-language model through the trainer on 2 CPU ranks (--lora_rank --load_in_4bit: bitsandbytes' CPU
backend, fp32 compute): a tiny pretrained Qwen2.5-VL (tiny-vl's architecture, saved as a model directory) under ZeRO-3,
one rank's micro-batch holding the image and the other's none at every step and evaluation. The run finishes, its
language model's linear layers are 4-bit and its tower and projector are not (the export holds the tower's weights
unchanged and the language model's rounded to NF4), it resumes exactly after kill -9, and its merged export loads with
its processor, answers with --image, computes what the adapter export computes on the 4-bit base, and equals the
offline export of the same checkpoint; under ZeRO-2 (the 4-bit values in bytes) its first steps' losses are the
same."""

from __future__ import annotations

import json
import sys

import pytest
import torch

import preloaded
from conftest import REPO, SRC, assert_ok, kill_after_checkpoint_then_resume, require_bitsandbytes, run_trainer
from test_vision_language import TOOL_ENV, mixed_rows  # noqa: F401 (the fixture)

require_bitsandbytes()

ARGS = ["--seq_len", "56", "--micro_batch_size", "1", "--ds_config", "configs/zero3.json", "--lora_rank", "4",
        "--lora_alpha", "8", "--lora_dropout", "0", "--learning_rate", "1e-2", "--load_in_4bit", "--max_steps", "4",
        "--checkpoint_freq", "2", "--eval_interval", "2", "--eval_iters", "1", "--log_interval", "1", "--trace_data",
        "--export_merged"]


def save_tiny_qwen2_5_vl(path) -> None:
    """tiny-vl's Qwen2.5-VL (a 2-block tower with its patch merger, a 2-layer decoder), random weights, saved with its
    processor: a pretrained model, so its tower is frozen and its projector trains by default."""
    from transformers import AutoModelForImageTextToText

    from model_utils.data.vision.processor import preset_processor
    from model_utils.models.vision.build import vision_model_config

    processor = preset_processor()
    torch.manual_seed(0)
    AutoModelForImageTextToText.from_config(vision_model_config("tiny-vl", processor)).save_pretrained(path)
    processor.save_pretrained(path)


@pytest.fixture(scope="module")
def qlora_vl(mixed_rows, tmp_path_factory, session_cache):  # noqa: F811 (pytest's fixture argument)
    """The ZeRO-3 run whole, and killed after its step-2 checkpoint then resumed; its first 2 steps under ZeRO-2."""
    root = tmp_path_factory.mktemp("qlora-vl")
    save_tiny_qwen2_5_vl(root / "model")
    args = [*ARGS, "--model", str(root / "model"), "--dataset", str(mixed_rows)]
    whole = run_trainer(root / "whole", args, timeout=300)
    assert_ok(whole)
    resumed = kill_after_checkpoint_then_resume(root / "resumed", args, step=2)
    zero2 = run_trainer(root / "zero2", [*args, "--ds_config", "ds_config.json", "--max_steps", "2", "--eval_interval",
                                         "0", "--checkpoint_freq", "0", "--no-export"], timeout=300)
    assert_ok(zero2)
    return root, whole, resumed, zero2


def test_a_zero3_qlora_run_finishes_with_a_rank_whose_micro_batches_hold_no_image(qlora_vl):
    root, whole, _, _ = qlora_vl
    assert "QLoRA: base in 4-bit NF4 with double quantization (bitsandbytes), computed in fp32, stored as float32 " \
           "(ZeRO-3 partitions it)" in whole.output
    assert "on the language model's" in whole.output and "over a 4-bit base (QLoRA)" in whole.output
    assert "vision tower 0.1M (frozen)" in whole.output and "the tower runs on every micro-batch" in whole.output
    traces = [[json.loads(line) for line in (whole.checkpoint_dir / "data_trace" / f"rank-{rank:05d}.jsonl")
               .read_text().splitlines()] for rank in (0, 1)]
    assert len(traces[0]) == 4 and all(sorted(zero["blocks"] + one["blocks"]) == [0, 1]
                                       for zero, one in zip(*traces))  # one block with the image, one without
    assert "eval step 2:" in whole.output and "eval (final) step 4:" in whole.output
    step = whole.checkpoint_dir / "step-00000004"
    states = torch.load(step / "zero_pp_rank_0_mp_rank_00_model_states.pt", weights_only=False)
    trained = [key for key in states["module"] if key not in states["shared_params"]]  # the tied head: a reference
    assert trained and all("lora_" in key or ".merger." in key for key in trained)  # the adapters, the projector
    assert any(".merger." in key for key in trained) and not any("absmax" in key or "quant" in key for key in trained)
    recorded = json.loads((step / "manifest.json").read_text())["lora"]
    assert recorded["load_in_4bit"] is True and recorded["vision_frozen"] == ["vision_tower"]


def test_zero2_stores_the_4bit_values_in_bytes_and_trains_the_same_steps(qlora_vl):
    _, whole, _, zero2 = qlora_vl
    assert "computed in fp32, stored as uint8" in zero2.output and "ZeRO stage 2" in zero2.output
    losses = zero2.losses_by_step()
    assert sorted(losses) == [1, 2] and all(loss == pytest.approx(whole.losses_by_step()[step], abs=1e-5)
                                            for step, loss in losses.items())


def test_the_language_models_linear_layers_are_4bit_and_the_tower_and_projector_are_not(qlora_vl):
    """The base the run builds (models.vision.quantized), and what its merged export holds: the frozen tower's weights
    exactly the pretrained ones, the language model's dequantized NF4 weights (changed, within NF4's rounding)."""
    import bitsandbytes as bnb
    from transformers import AutoConfig, AutoModelForImageTextToText

    from model_utils.models.quantization import Quantization
    from model_utils.models.vision.quantized import quantized_vision_model

    root, whole, _, _ = qlora_vl
    base = quantized_vision_model(str(root / "model"), AutoConfig.from_pretrained(root / "model"),
                                  Quantization("fp32", 3), "cpu")
    linear = {name: type(m) for name, m in base.named_modules() if isinstance(m, (torch.nn.Linear, bnb.nn.Linear4bit))}
    four_bit = {name for name, kind in linear.items() if kind is bnb.nn.Linear4bit}
    assert four_bit == {name for name in linear if name.startswith("model.language_model.")} and len(four_bit) == 14
    assert not any(name.startswith("model.visual.") for name in four_bit) and "lm_head" not in four_bit
    pretrained, merged = (dict(AutoModelForImageTextToText.from_pretrained(path).named_parameters())
                          for path in (root / "model", whole.checkpoint_dir / "hf" / "merged"))
    for name, weight in pretrained.items():
        if ".blocks." in name or "patch_embed" in name:  # the frozen tower: never quantized
            assert torch.equal(merged[name], weight), name
    q_proj = "model.language_model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(merged[q_proj], pretrained[q_proj])
    assert (merged[q_proj] - pretrained[q_proj]).abs().max() < 0.2 * pretrained[q_proj].abs().max()
    recorded = json.loads((whole.checkpoint_dir / "hf" / "adapter" / "base_quantization.json").read_text())
    assert recorded["llm_int8_skip_modules"] == ["model.visual", "lm_head"]


def test_a_vision_qlora_run_resumes_exactly_after_kill_9(qlora_vl):
    _, whole, resumed, _ = qlora_vl
    first, again = whole.losses_by_step(), resumed.losses_by_step()
    assert sorted(first) == [1, 2, 3, 4] and [again[s] for s in (3, 4)] == [first[s] for s in (3, 4)]


def test_the_merged_export_answers_about_an_image_and_equals_the_offline_export(qlora_vl, mixed_rows,  # noqa: F811
                                                                                 tmp_path):
    from transformers import AutoModelForImageTextToText

    root, whole, resumed, _ = qlora_vl
    export = resumed.checkpoint_dir / "hf" / "merged"
    assert "quantization_config" not in json.loads((export / "config.json").read_text())
    assert "image_processor" in (export / "processor_config.json").read_text()
    done = preloaded.run([sys.executable, "-m", "model_utils.generate", "--model", str(export), "--image",
                          str(mixed_rows / "red.png"), "--chat", "What colour are the shapes?", "--max_new_tokens",
                          "4"], cwd=REPO, env=TOOL_ENV, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    adapter = whole.checkpoint_dir / "hf" / "adapter"  # on its base loaded in 4-bit as the run quantized it
    done = preloaded.run([sys.executable, "-m", "model_utils.generate", "--model", str(adapter), "--image",
                          str(mixed_rows / "red.png"), "--chat", "What colour are the shapes?", "--max_new_tokens",
                          "4"], cwd=REPO, env=TOOL_ENV, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    offline = preloaded.run([sys.executable, "-m", "model_utils.export", str(whole.checkpoint_dir), "--output",
                             str(tmp_path / "offline"), "--merged", "--dtype", "float32"], cwd=REPO,
                            env={**TOOL_ENV, "PYTHONPATH": str(SRC)}, capture_output=True, text=True, timeout=300)
    assert offline.returncode == 0, offline.stderr[-3000:]
    assert (tmp_path / "offline" / "merged" / "processor_config.json").exists()
    again, run = (dict(AutoModelForImageTextToText.from_pretrained(path).named_parameters())
                  for path in (tmp_path / "offline" / "merged", whole.checkpoint_dir / "hf" / "merged"))
    assert again.keys() == run.keys()
    for name, weight in run.items():
        torch.testing.assert_close(again[name], weight, rtol=1e-5, atol=1e-6)


def test_the_merged_export_computes_what_the_adapter_computes_on_the_4bit_base(qlora_vl, mixed_rows):  # noqa: F811
    """The adapter export on its base quantized as base_quantization.json records it (the tower and head skipped),
    against the merged export, on an image and a question."""
    from PIL import Image
    from transformers import AutoModelForImageTextToText

    from model_utils.data.vision.processor import load_processor
    from model_utils.models.quantization import recorded_base_quantization

    _, whole, _, _ = qlora_vl
    export = whole.checkpoint_dir / "hf"
    processor = load_processor(str(export / "merged"), "qwen2_5_vl")
    inputs = processor(text=[processor.image_token + "What colour are the shapes?"],
                       images=[Image.open(mixed_rows / "red.png")], return_tensors="pt")
    merged = AutoModelForImageTextToText.from_pretrained(export / "merged").eval()
    on_4bit = AutoModelForImageTextToText.from_pretrained(
        export / "adapter", quantization_config=recorded_base_quantization(export / "adapter", torch.float32)).eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(**inputs).logits, on_4bit(**inputs).logits, rtol=1e-4, atol=1e-4)
