"""Vision-language models: the three parts found by name and frozen as asked, a learning rate per part that follows
the schedule, LoRA on the language model only, the vision tower run on a blank image where a micro-batch has no
image (its loss the text-only loss exactly, its gradient through the projector zero), and the tower's FLOPs."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from model_utils.config.settings import LoraSettings
from model_utils.data.vision.processor import preset_processor
from model_utils.models.vision.build import build_vision_model, language_model_layers, vision_model_config
from model_utils.models.vision.flops import VisionFlops
from model_utils.models.vision.parts import (freeze_problems, language_model_targets, lr_scales, parse_parts,
                                             part_groups, part_of)
from model_utils.models.vision.tower import run_tower_on_every_batch


@pytest.fixture(scope="module")
def processor():
    return preset_processor()


@pytest.fixture(scope="module")
def config(processor):
    return vision_model_config("tiny-vl", processor)


def tiny(config, frozen=("vision_tower",), checkpointing=False):
    torch.manual_seed(0)
    return build_vision_model("tiny-vl", config, torch.float32, "sdpa", checkpointing, frozen)


def test_the_parts_are_found_by_their_names_and_frozen_as_asked(config):
    assert part_of("model.visual.blocks.0.attn.qkv.weight") == "vision_tower"
    assert part_of("model.visual.merger.mlp.0.weight") == "projector"
    assert part_of("model.multi_modal_projector.linear_1.weight") == "projector"
    assert part_of("model.language_model.layers.0.mlp.gate_proj.weight") == "language_model"
    assert part_of("lm_head.weight") == "language_model"
    model = tiny(config)
    trains = {part_of(name) for name, p in model.named_parameters() if p.requires_grad}
    assert trains == {"projector", "language_model"}
    assert {part_of(name) for name, p in tiny(config, ("language_model", "projector")).named_parameters()
            if p.requires_grad} == {"vision_tower"}
    assert len(language_model_layers(model)) == config.get_text_config().num_hidden_layers


@pytest.mark.parametrize("given, lora, message", [
    ("vision_tower,decoder", False, "names decoder, not a part"),
    ("vision_tower,projector,language_model", False, "freezes every part"),
    ("language_model", True, "freezes the language model, and LoRA trains adapters on it"),
])
def test_a_freeze_that_cannot_train_is_refused(given, lora, message):
    problems = freeze_problems(given, lora)
    assert len(problems) == 1 and problems[0].setting == "--freeze" and message in problems[0].message
    assert freeze_problems(None, True) == [] and parse_parts("none") == () and parse_parts(None) == ("vision_tower",)


def test_lora_adapts_the_language_models_layers_only_and_trains_the_projector_whole(config):
    from model_utils.models.lora import apply_lora

    settings = LoraSettings(rank=4, alpha=8, vision_frozen=("vision_tower",))
    wrapped = apply_lora(tiny(config), settings)
    adapted = {name.rsplit(".lora_A", 1)[0] for name, _ in wrapped.named_modules() if name.endswith("lora_A")}
    assert adapted and all(part_of(name) == "language_model" for name in adapted)
    assert any("visual.blocks.0.mlp.gate_proj" in name for name, _ in wrapped.named_modules())  # a same-named layer
    trains = {part_of(name) for name, p in wrapped.named_parameters() if p.requires_grad}
    assert trains == {"projector", "language_model"}  # the projector through modules_to_save
    assert not any(p.requires_grad for name, p in wrapped.named_parameters() if part_of(name) == "vision_tower")
    pattern = language_model_targets(["q_proj", "gate_proj"])
    assert re.fullmatch(pattern, "model.language_model.layers.3.mlp.gate_proj")
    assert not re.fullmatch(pattern, "model.visual.blocks.0.mlp.gate_proj")


def test_each_part_keeps_its_factor_of_the_scheduled_rate(config):
    from model_utils.models.build import decay_groups
    from model_utils.models.vision.parts import keep_lr_scales

    model = tiny(config, frozen=())
    scales = lr_scales((), 1e-3, tower_lr=1e-4, projector_lr=2e-3)
    assert scales == {"language_model": 1.0, "vision_tower": pytest.approx(0.1), "projector": pytest.approx(2.0)}
    groups = part_groups(model, decay_groups, 0.1, scales)
    assert groups[0]["part"] == "language_model"  # the rate the log shows
    # DeepSpeed's own scheduler over the optimizer the engine would hold (what keep_lr_scales reads of an engine)
    from types import SimpleNamespace

    from deepspeed.runtime.lr_schedules import WarmupLR

    optimizer = torch.optim.AdamW(groups, lr=1e-3)
    engine = SimpleNamespace(optimizer=optimizer, lr_scheduler=WarmupLR(optimizer, 0, 1e-3, 4, "linear"))
    engine.lr_scheduler.step(0)
    assert keep_lr_scales(engine)
    for _ in range(3):
        engine.lr_scheduler.step()
        rates = {g["part"]: g["lr"] for g in optimizer.param_groups}
        assert rates["vision_tower"] == pytest.approx(0.1 * rates["language_model"])
        assert rates["projector"] == pytest.approx(2.0 * rates["language_model"])
        assert rates["language_model"] == engine.lr_scheduler.get_last_lr()[0] > 0


def test_a_batch_without_images_runs_the_tower_and_keeps_its_loss(processor, config):
    model = tiny(config).train()
    ids = torch.arange(10, 40)[None]
    plain = model(input_ids=ids, labels=ids, use_cache=False).loss
    hooks = run_tower_on_every_batch(model, model, processor, torch.device("cpu"))
    seen = []
    handle = model.model.visual.register_forward_hook(lambda *args: seen.append(1))
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    assert loss.item() == plain.item() and hooks.runs == 1 and seen == [1]  # the tower ran, the loss is unchanged
    loss.backward()
    projector = [p.grad for name, p in model.named_parameters() if part_of(name) == "projector"]
    assert all(g is not None and not g.any() for g in projector)  # traced, and its gradient is zero
    with_image = dict(processor(text=[processor.image_token + "Red."], images=[__import__("PIL.Image").Image.new(
        "RGB", (56, 56))], return_tensors="pt"))
    with_image.pop("attention_mask")
    model(**with_image, use_cache=False)
    assert hooks.runs == 1 and seen == [1, 1]  # a batch with images runs the tower itself, once
    handle.remove()
    hooks.remove()


def test_the_towers_flops_follow_what_trains():
    frozen = VisionFlops(tower_params=1000, projector_params=100, tower_layers=2, tower_hidden=8, tower_trains=False,
                         projector_trains=True)
    assert frozen.flops([4, 16], 5) == 2 * 1000 * 20 + 4 * 2 * 8 * (16 + 256) + 6 * 100 * 5
    trained = dataclasses.replace(frozen, tower_trains=True)
    assert trained.flops([4], 1) == 6 * 1000 * 4 + 12 * 2 * 8 * 16 + 6 * 100
