"""Vision-language models: the three parts found by name and frozen as asked, a learning rate per part that follows
the schedule, LoRA on the language model only, the vision tower run on a blank image where a micro-batch has no
image (its loss the text-only loss exactly, its gradient through the projector zero), and the tower's FLOPs."""

from __future__ import annotations

import copy
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


def tiny_qwen3_vl():
    """(processor, model) of a tiny Qwen3-VL, random weights: the shipped tokenizer with the vision tokens, Qwen3-VL's
    image processor settings (16-pixel patches, mean and std 0.5), a tower of 2 blocks whose both blocks feed a
    deepstack merger, a decoder of 2 layers with interleaved mRoPE; the tower frozen (a pretrained model's default)."""
    from transformers import AutoModelForImageTextToText, Qwen3VLConfig

    from model_utils.data.vision.processor import IMAGE_PAD, VIDEO_PAD, VISION_END, VISION_START
    from model_utils.models.vision.parts import freeze

    processor = preset_processor("Qwen2VLImageProcessor", "Qwen3VLProcessor")
    images = processor.image_processor
    images.patch_size, images.image_mean, images.image_std = 16, [0.5] * 3, [0.5] * 3
    images.size = {"shortest_edge": 32 * 32, "longest_edge": 256 * 256}
    tokenizer = processor.tokenizer
    ids = dict(zip(("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id"),
                   tokenizer.convert_tokens_to_ids([VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD])))
    config = Qwen3VLConfig(
        text_config=dict(vocab_size=-(-len(tokenizer) // 64) * 64, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         rope_parameters={"rope_type": "default", "rope_theta": 10_000.0, "mrope_section": [2, 3, 3],
                                          "mrope_interleaved": True}),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           num_position_embeddings=64, deepstack_visual_indexes=[0, 1]), **ids)
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config, attn_implementation="sdpa")
    freeze(model, ("vision_tower",))
    return processor, model


@pytest.mark.parametrize("family", ["qwen2.5-vl", "qwen3-vl"])
def test_a_batch_without_images_runs_the_tower_and_keeps_its_loss(processor, config, family):
    """Qwen3-VL's deepstack features (its deepstack mergers' outputs, added in its first decoder layers) are taken
    too: each projector module gets its gradient, zero."""
    from PIL import Image

    if family == "qwen3-vl":
        processor, model = tiny_qwen3_vl()
        model.train()
    else:
        model = tiny(config).train()
    ids = torch.arange(10, 40)[None]
    plain = model(input_ids=ids, labels=ids, use_cache=False).loss
    hooks = run_tower_on_every_batch(model, model, processor, torch.device("cpu"))
    seen = []
    handle = model.model.visual.register_forward_hook(lambda *args: seen.append(1))
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    assert loss.item() == plain.item() and hooks.runs == 1 and seen == [1]  # the tower ran, the loss is unchanged
    loss.backward()
    projector = {name: p.grad for name, p in model.named_parameters() if part_of(name) == "projector"}
    assert all(g is not None and not g.any() for g in projector.values())  # traced, and its gradient is zero
    assert any(".deepstack_merger_list." in name for name in projector) == (family == "qwen3-vl")
    with_image = dict(processor(text=[processor.image_token + "Red."], images=[Image.new("RGB", (56, 56))],
                                return_tensors="pt"))
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


# ----------------------------------------------------------------------------------------------------------------------
# What a forward keeps for the backward pass: storages made by the forward's ops and still alive after it, by part
# ----------------------------------------------------------------------------------------------------------------------
def kept_bytes_by_part(model, inputs: dict) -> tuple[dict, object]:
    """Bytes of every storage an op of `model`'s forward made that is still alive once the forward has returned (what
    its autograd graph keeps for the backward pass, inputs and parameters apart), by the part (models.vision.parts)
    whose module made it, and those of the tower's blocks (tower_blocks, within vision_tower's) and of the language
    model's decoder layers (decoder_layers); and the loss."""
    import weakref

    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    names = {module: name for name, module in model.named_modules()}
    running, made = [], {}
    hooks = [h for m in model.modules() for h in (
        m.register_forward_pre_hook(lambda module, args: running.append(names[module])),
        m.register_forward_hook(lambda module, args, out: (running.pop(), None)[1]))]

    class Made(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    storage = t.untyped_storage()
                    seen = made.get(storage.data_ptr())
                    if seen is None or seen[0]() is None:
                        made[storage.data_ptr()] = (weakref.ref(storage), storage.nbytes(), running[-1])
            return out

    with Made():
        loss = model(**inputs, use_cache=False).loss
    for h in hooks:
        h.remove()
    outside = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers(), *inputs.values()]
               if isinstance(t, torch.Tensor)}
    kept = dict.fromkeys(("vision_tower", "projector", "language_model", "tower_blocks", "decoder_layers"), 0)
    for ptr, (storage, nbytes, name) in made.items():
        if storage() is not None and ptr not in outside:
            name = name.replace("base_model.model.", "").replace(".modules_to_save.default", "")
            part = part_of(name)
            kept[part] += nbytes
            kept["tower_blocks"] += nbytes if part == "vision_tower" and ".blocks." in name else 0
            kept["decoder_layers"] += nbytes if name.startswith("model.language_model.layers.") else 0
    return kept, loss


def image_inputs(processor, side: int = 224) -> dict:
    from PIL import Image

    inputs = dict(processor(text=[processor.image_token + "Red, and a long answer about it."],
                            images=[Image.new("RGB", (side, side), (200, 30, 30))], return_tensors="pt"))
    inputs.pop("attention_mask")
    inputs["labels"] = inputs["input_ids"].clone()
    return inputs


def test_a_frozen_tower_keeps_nothing_for_the_backward_under_checkpointing_and_lora(processor, config):
    """transformers' enable_input_require_grads (checkpointing's, then LoRA's) hooks every input embedding, the
    tower's patch embedding too: a frozen tower then kept each block's working set for a backward pass whose only
    result, the pixels' gradient, nothing reads (~10.6 GiB a 4,096-token block of Qwen2.5-VL-7B). It builds no graph
    now, and what trains gets the same gradients."""
    from model_utils.models.lora import apply_lora

    settings = LoraSettings(rank=4, alpha=8, dropout=0.0, vision_frozen=("vision_tower",))
    inputs = image_inputs(processor)
    grads, kept = [], []
    for old_hook in (False, True):
        model = apply_lora(tiny(config, checkpointing=True), settings).train()
        tower = model.get_base_model().model.visual
        assert tower.get_input_embeddings() is None
        if old_hook:  # what transformers' hook did before
            tower.patch_embed.register_forward_hook(lambda module, args, out: out.requires_grad_(True))
        by_part, loss = kept_bytes_by_part(model, inputs)
        loss.backward()
        kept.append(by_part)
        grads.append({name: p.grad for name, p in model.named_parameters() if p.requires_grad})
    assert kept[0]["tower_blocks"] == 0 < kept[1]["tower_blocks"]
    assert kept[0]["vision_tower"] <= 1024  # the tower's own positions and window order, no activation
    assert kept[0]["language_model"] == kept[1]["language_model"]
    assert grads[0].keys() == grads[1].keys()
    assert any(part_of(name) == "projector" for name in grads[0])
    for name, grad in grads[0].items():
        assert grad is not None and torch.equal(grad, grads[1][name]), name


@pytest.mark.parametrize("frozen, checkpointing", [(("vision_tower",), True), ((), True), ((), False)])
def test_the_estimate_holds_what_the_tower_and_projector_keep(processor, config, frozen, checkpointing):
    """planning.vision.VisionPlan.activation_bytes against the bytes tiny-vl's tower (widened) and projector keep after
    a forward in 16-bit (a frozen tower: the projector's alone), within 25%; and the checkpointed decoder layers keep
    their inputs only, 2·h bytes a token each (what models.memory.activation_bytes counts of a recomputed layer): each
    layer's output is the next one's kept input, the last one's is not kept (the final norm keeps its fp32 copy)."""
    from model_utils.planning.vision import VisionPlan

    config = copy.deepcopy(config)  # a tower of Qwen2.5-VL-7B's head width (128) and MLP ratio, 4 blocks
    config.vision_config.update(dict(hidden_size=256, intermediate_size=684, num_heads=2, depth=4,
                                     fullatt_block_indexes=[3]))
    model = build_vision_model("tiny-vl", config, torch.bfloat16, "sdpa", checkpointing, frozen).train()
    inputs = image_inputs(processor)
    inputs["pixel_values"] = inputs["pixel_values"].to(torch.bfloat16)
    kept, _ = kept_bytes_by_part(model, inputs)
    image_tokens = int((inputs["input_ids"] == config.image_token_id).sum())
    plan = VisionPlan(processor, config, frozen, {}, None, None, "", checkpointing)
    estimate = plan.activation_bytes(1, image_tokens, bf16=True)
    measured = kept["vision_tower"] + kept["projector"]
    assert estimate == pytest.approx(measured, rel=0.25)
    text = config.get_text_config()
    tokens, h = inputs["input_ids"].numel(), text.hidden_size
    if checkpointing:
        assert kept["decoder_layers"] == (text.num_hidden_layers - 1) * 2 * h * tokens
