"""QLoRA's base of a vision-language model (models.vision.quantized) on CPU: a preset's language model's linear layers
in 4-bit and nothing else, the adapters and the projector trained through them; a checkpoint stored in 4-bit already
whose tower or projector holds 4-bit layers refused where that part trains."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import require_bitsandbytes

require_bitsandbytes()

import bitsandbytes as bnb  # noqa: E402

from model_utils.config.settings import LoraSettings  # noqa: E402
from model_utils.data.vision.processor import preset_processor  # noqa: E402
from model_utils.models.quantization import Quantization, prepare_for_training, quantized_sizes  # noqa: E402
from model_utils.models.vision.build import build_vision_model, meta_vision_model, vision_model_config  # noqa: E402
from model_utils.models.vision.parts import part_of  # noqa: E402
from model_utils.models.vision.quantized import (in_language_model, sixteen_bit_modules, stored_in_4bit,  # noqa: E402
                                                 stored_part_problems)


@pytest.fixture(scope="module")
def processor():
    return preset_processor()


@pytest.fixture(scope="module")
def config(processor):
    return vision_model_config("tiny-vl", processor)


def test_the_language_models_linear_layers_are_4bit_and_train_their_adapters_beside_the_projector(processor, config):
    """tiny-vl's base as the run builds a preset's: 4-bit layers exactly the language model's linear ones (the plan
    counts the same), and one step's backward through them with an image reaches the adapters and the projector
    trained whole, never the frozen tower (a few seconds: quantizing, peft's wrapping, a forward and backward)."""
    from PIL import Image

    from model_utils.models.lora import apply_lora

    torch.manual_seed(0)
    model = build_vision_model("tiny-vl", config, torch.float32, "sdpa", False, ("vision_tower",),
                               quantization=Quantization("fp32", 2), device="cpu")
    prepare_for_training(model)
    linear = {name: module for name, module in model.named_modules()
              if isinstance(module, (torch.nn.Linear, bnb.nn.Linear4bit))}
    four_bit = {name for name, module in linear.items() if isinstance(module, bnb.nn.Linear4bit)}
    assert four_bit == {name for name in linear if in_language_model(name) and name != "lm_head"} and four_bit
    assert {part_of(name) for name in set(linear) - four_bit} == {"vision_tower", "projector", "language_model"}
    assert sixteen_bit_modules(model) == ["model.visual", "lm_head"]
    meta = dict(meta_vision_model(config, ()).named_modules())  # what the plan counts: the same layers, unpacked
    assert quantized_sizes(meta[""], stored_in_4bit(config, meta[""])) == (
        sum(meta[name].weight.numel() for name in four_bit), max(meta[name].weight.numel() for name in four_bit))
    wrapped = apply_lora(model, LoraSettings(rank=4, alpha=8, dropout=0.0, vision_frozen=("vision_tower",)))
    inputs = dict(processor(text=[processor.image_token + "Red, and a long answer about it."],
                            images=[Image.new("RGB", (56, 56), (200, 30, 30))], return_tensors="pt"))
    inputs.pop("attention_mask")
    wrapped(**inputs, labels=inputs["input_ids"].clone(), use_cache=False).loss.backward()
    grads = {name: p.grad for name, p in wrapped.named_parameters() if p.requires_grad}
    assert {part_of(name) for name in grads} == {"language_model", "projector"}
    assert all(grads[name].abs().sum() > 0 for name in grads if "lora_B" in name or ".merger." in name)


def stored(config, skipped):
    """`config` as a checkpoint stored in 4-bit by bitsandbytes records it, skipping `skipped` (None: the default)."""
    stored = copy.deepcopy(config)
    stored.quantization_config = {"quant_method": "bitsandbytes", "load_in_4bit": True,
                                  "llm_int8_skip_modules": skipped}
    return stored


def test_a_4bit_checkpoint_whose_trained_parts_are_4bit_is_refused(config):
    """Stored with transformers' default skips (the LM head only), its tower and projector are 4-bit: a projector
    that trains (a pretrained model's default) or a tower that trains is refused, naming --model and the fix; with
    both frozen, or stored with them skipped, it trains (and the estimate counts what it stores in 4-bit)."""
    everything = stored(config, None)
    meta = meta_vision_model(everything, ())
    [problem] = stored_part_problems(everything, meta, ("vision_tower",), "vl-bnb-4bit")
    assert problem.setting == "--model" and problem.value == "vl-bnb-4bit"
    assert "stores its projector's linear layers in 4-bit" in problem.message
    assert "--freeze projector,vision_tower" in problem.fix and "16-bit weights" in problem.fix
    [both] = stored_part_problems(everything, meta, (), "vl-bnb-4bit")
    assert "vision tower and projector" in both.message
    assert stored_part_problems(everything, meta, ("vision_tower", "projector"), "vl-bnb-4bit") == []
    assert quantized_sizes(meta, stored_in_4bit(everything, meta))[0] > quantized_sizes(meta, in_language_model)[0]
    ours = stored(config, ["model.visual", "lm_head"])
    assert stored_part_problems(ours, meta_vision_model(ours, ()), (), "vl-bnb-4bit") == []
    assert stored_part_problems(config, meta_vision_model(config, ()), (), "tiny-vl") == []  # quantized by the run


def tiny_family(family: str):
    """A tiny model of another family, random weights: LLaVA (a CLIP tower, a linear projector, a Llama decoder) or
    Qwen3-VL (its deepstack mergers inside the tower)."""
    from transformers import (AutoModelForImageTextToText, CLIPVisionConfig, LlamaConfig, LlavaConfig,
                              Qwen3VLConfig)

    if family == "llava":
        config = LlavaConfig(vision_config=CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                                            num_attention_heads=2, image_size=56, patch_size=14),
                             text_config=LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
                             image_token_id=255)
    else:
        config = Qwen3VLConfig(
            text_config=dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                             rope_parameters={"rope_type": "default", "rope_theta": 10_000.0,
                                              "mrope_section": [2, 3, 3], "mrope_interleaved": True}),
            vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                               num_position_embeddings=64, deepstack_visual_indexes=[0, 1]),
            image_token_id=250, video_token_id=251, vision_start_token_id=252, vision_end_token_id=253)
    torch.manual_seed(0)
    return AutoModelForImageTextToText.from_config(config)


@pytest.mark.parametrize("family, skipped", [
    ("llava", ["lm_head", "model.multi_modal_projector", "model.vision_tower"]),
    ("qwen3-vl", ["lm_head", "model.visual"]),
])
def test_other_families_load_their_language_models_linear_layers_in_4bit(family, skipped, tmp_path):
    """A pretrained model loaded quantized by transformers (the path of a model directory): its tower and projector
    (Qwen3-VL's deepstack mergers too) named as skipped modules and kept 16-bit, its language model's layers 4-bit."""
    from transformers import AutoConfig

    from model_utils.models.vision.quantized import quantized_vision_model

    tiny_family(family).save_pretrained(tmp_path)
    config = AutoConfig.from_pretrained(tmp_path)
    model = quantized_vision_model(str(tmp_path), config, Quantization("fp32", 3), "cpu")
    assert sorted(model.config.quantization_config.llm_int8_skip_modules) == skipped
    linear = {name: isinstance(module, bnb.nn.Linear4bit) for name, module in model.named_modules()
              if isinstance(module, (torch.nn.Linear, bnb.nn.Linear4bit))}
    assert {name for name, four in linear.items() if four} == {
        name for name in linear if in_language_model(name) and name != "lm_head"}
    assert any(".deepstack_merger_list." in name for name in linear) == (family == "qwen3-vl")
    assert {part_of(name) for name, four in linear.items() if not four} == {"vision_tower", "projector",
                                                                           "language_model"}
