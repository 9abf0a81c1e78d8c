"""What `--model` names when it is a vision-language model: a preset (config.presets.VISION_PRESETS: the Qwen2.5-VL
architecture from random weights, with the shipped tokenizer and the vision tokens added), or any model directory or
hub id whose config transformers' AutoModelForImageTextToText builds (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, LLaVA, Gemma 3,
...). Its config, its build (random or pretrained, activation checkpointing on the language model's layers), and its
size on the meta device with the parts frozen as the run freezes them.
"""

from __future__ import annotations

from model_utils.config.presets import VISION_PRESETS, is_vision_preset
from model_utils.models.vision.parts import freeze


def is_vision_config(config) -> bool:
    """A config transformers builds a vision-language model of (AutoModelForImageTextToText), with a vision tower."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return (getattr(config, "vision_config", None) is not None
            and getattr(config, "model_type", None) in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)


def is_vision_model(name: str) -> bool:
    """Whether `--model` names a vision-language model: a vision preset, or a directory or hub id whose config is one
    (read from its config.json; a name whose config cannot be read here is left to the text path to report)."""
    from model_utils.config.presets import is_preset

    if is_vision_preset(name):
        return True
    if is_preset(name):
        return False
    from transformers import AutoConfig

    try:
        return is_vision_config(AutoConfig.from_pretrained(name))
    except (OSError, ValueError, KeyError):
        return False


def _round_up(n: int, multiple: int = 64) -> int:
    return (n + multiple - 1) // multiple * multiple


def vision_model_config(name: str, processor, attention_dropout: float | None = None):
    """The config of a vision preset (its vocabulary sized to the processor's tokenizer, the vision tokens' ids its
    own) or of a model directory or hub id."""
    from transformers import AutoConfig

    if is_vision_preset(name):
        from transformers import Qwen2_5_VLConfig

        from model_utils.data.vision.processor import IMAGE_PAD, VIDEO_PAD, VISION_END, VISION_START

        preset = VISION_PRESETS[name.lower()]
        tokenizer = processor.tokenizer
        ids = dict(zip(("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id"),
                       tokenizer.convert_tokens_to_ids([VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD])))
        text = dict(preset["text_config"])
        if text.get("vocab_size") is None:
            text["vocab_size"] = _round_up(len(tokenizer))
        text.update(eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
                    pad_token_id=tokenizer.pad_token_id)
        config = Qwen2_5_VLConfig(text_config=text, vision_config=dict(preset["vision_config"]), **ids,
                                  tie_word_embeddings=text.get("tie_word_embeddings", False),
                                  eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
                                  pad_token_id=tokenizer.pad_token_id)
    else:
        config = AutoConfig.from_pretrained(name)
    if attention_dropout is not None:
        config.get_text_config().attention_dropout = attention_dropout
    return config


def build_vision_model(name: str, config, dtype, attn_implementation: str, gradient_checkpointing: bool,
                       frozen: tuple[str, ...], checkpointed_layers: int | None = None, quantization=None,
                       device=None):
    """A preset from random weights, or a pretrained model (its config already loaded), with the `frozen` parts'
    weights frozen. Under ZeRO-3 the caller enters zero.Init (HfDeepSpeedConfig), as for text models. With
    `gradient_checkpointing`, the language model's first `checkpointed_layers` decoder layers recompute (None: all;
    the vision tower's blocks too where it trains). `quantization` (models.quantization.Quantization, QLoRA): the
    language model's linear layers in 4-bit on `device` (models.vision.quantized)."""
    from transformers import AutoModelForImageTextToText

    from model_utils.models.build import checkpointable_layers, enable_activation_checkpointing
    from model_utils.models.vision.parts import keep_frozen_tower_out_of_autograd
    from model_utils.models.vision.quantized import quantized_vision_model

    if quantization is not None:
        model = quantized_vision_model(name, config, quantization, device, attn_implementation)
    elif is_vision_preset(name):
        model = AutoModelForImageTextToText.from_config(config, dtype=dtype, attn_implementation=attn_implementation)
    else:
        model = AutoModelForImageTextToText.from_pretrained(name, config=config, dtype=dtype,
                                                            attn_implementation=attn_implementation)
    freeze(model, frozen)
    keep_frozen_tower_out_of_autograd(model, frozen)  # before checkpointing's (and LoRA's) input-gradient hooks
    if gradient_checkpointing:
        enable_activation_checkpointing(model)
        layers = language_model_layers(model)
        if checkpointed_layers is not None:
            for layer in layers[checkpointed_layers:]:
                layer.gradient_checkpointing = False
        if "vision_tower" in frozen:  # a frozen tower keeps no activations for a backward: nothing to recompute
            for layer in checkpointable_layers(model):
                if not any(layer is kept for kept in layers):
                    layer.gradient_checkpointing = False
    model.config.use_cache = False
    return model


def language_model_layers(model) -> list:
    """The language model's decoder layers (what --checkpointed_layers counts and the compiled layers are)."""
    from model_utils.models.build import checkpointable_layers
    from model_utils.models.vision.parts import part_of

    named = {id(module): name for name, module in model.named_modules()}
    return [layer for layer in checkpointable_layers(model) if part_of(named[id(layer)]) == "language_model"]


def meta_vision_model(config, frozen: tuple[str, ...]):
    """The model on the meta device, its tied weights tied and the `frozen` parts frozen: what the plan sizes."""
    import torch
    from transformers import AutoModelForImageTextToText

    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config)
        model.tie_weights()
    freeze(model, frozen)
    return model
