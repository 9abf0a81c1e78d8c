"""QLoRA's base of a vision-language model (--lora_rank with --load_in_4bit): the language model's linear layers in
4-bit NF4, by the text models' machinery (models.quantization); the vision tower, the projector, the output head and
the embeddings in the compute dtype (16-bit on GPUs), as peft's, TRL's and Unsloth's QLoRA of vision-language models
keep them: the tower and the projector are small beside the language model, and a projector that trains is trained
whole (peft's modules_to_save), which a 4-bit layer cannot be.

A preset is built with random weights and its language model's layers replaced by bitsandbytes' Linear4bit
(quantization.quantize_layers with `keep`); a pretrained model is loaded quantized by transformers, the tower, the
projector and the head named as the modules it skips (`llm_int8_skip_modules`). A checkpoint stored in 4-bit already
loads with its own skipped modules; the parts that train must be among them (stored_part_problems).
"""

from __future__ import annotations

from model_utils.config.presets import is_vision_preset
from model_utils.core.problems import Problem
from model_utils.models.vision.parts import part_of


def in_language_model(name: str) -> bool:
    """Whether the module of this dotted name is the language model's: the layers a QLoRA base quantizes
    (quantization.quantizable_layers' `keep`)."""
    return part_of(name) == "language_model"


def sixteen_bit_modules(model) -> list[str]:
    """The full names of the modules a QLoRA base keeps out of 4-bit: the outermost modules of the vision tower and
    of the projector, and the output head (transformers' own choice for text models)."""
    names = {id(module): name for name, module in model.named_modules()}
    kept = [name for name in names.values() if name and not in_language_model(name)
            and in_language_model(name.rpartition(".")[0])]
    head = model.get_output_embeddings()
    return sorted(kept) + ([names[id(head)]] if head is not None and id(head) in names else [])


def quantization_skip_modules(config) -> list[str]:
    """sixteen_bit_modules of a model of `config`, named on the model built on the meta device."""
    import torch
    from transformers import AutoModelForImageTextToText

    with torch.device("meta"):
        return sixteen_bit_modules(AutoModelForImageTextToText.from_config(config))


def quantized_vision_model(name: str, config, quantization, device, attn_implementation: str = "sdpa"):
    """The 4-bit base of the vision-language model `name` (a preset or a pretrained model, `config` already loaded):
    its language model's linear layers in 4-bit on `device`, the rest in `quantization`'s compute dtype. Built whole:
    under ZeRO-3 deepspeed.initialize partitions it, as for text models."""
    from transformers import AutoModelForImageTextToText

    from model_utils.models.quantization import load_quantized, quantize_layers

    if is_vision_preset(name):
        model = AutoModelForImageTextToText.from_config(config, dtype=quantization.compute_dtype,
                                                        attn_implementation=attn_implementation)
        quantize_layers(model, quantization, device, keep=in_language_model)
        return model
    stored = getattr(config, "quantization_config", None)  # a 4-bit checkpoint: its own skipped modules
    return load_quantized(name, config, quantization, device, attn_implementation, AutoModelForImageTextToText,
                          skip_modules=None if stored else quantization_skip_modules(config))


def stored_in_4bit(config, model):
    """Which linear layers (by dotted name) a 4-bit base of `config` holds in 4-bit, `model` its build on the meta
    device: the language model's, or for a checkpoint stored in 4-bit already, those its quantization_config does not
    skip (transformers' own matching: its llm_int8_skip_modules, else the output head and tied weights, and the
    model's fp32 modules)."""
    stored = getattr(config, "quantization_config", None)
    if stored is None:
        return in_language_model
    from transformers.quantizers.base import get_keys_to_not_convert
    from transformers.quantizers.quantizers_utils import should_convert_module

    recorded = stored if isinstance(stored, dict) else stored.to_dict()
    skipped = list(recorded.get("llm_int8_skip_modules") or get_keys_to_not_convert(model))
    skipped += list(getattr(model, "_keep_in_fp32_modules", None) or [])
    return lambda name: should_convert_module(name, skipped)


def stored_part_problems(config, model, frozen: tuple[str, ...], model_name: str) -> list[Problem]:
    """A checkpoint stored in 4-bit whose tower or projector holds 4-bit layers while that part trains (--freeze):
    a 4-bit weight does not train. `model`: the model on the meta device."""
    import torch

    if getattr(config, "quantization_config", None) is None:
        return []
    four_bit = stored_in_4bit(config, model)
    head = model.get_output_embeddings()
    held = {part_of(name) for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear) and module is not head and four_bit(name)}
    trained = [part for part in ("vision_tower", "projector") if part in held and part not in frozen]
    if not trained:
        return []
    names = " and ".join(part.replace("_", " ") for part in trained)
    return [Problem("--model", model_name, f"stores its {names}'s linear layers in 4-bit (its quantization_config "
                    f"does not skip them), and the run trains {'them' if len(trained) > 1 else 'it'}: a 4-bit weight "
                    "does not train", f"add {','.join(trained)} to --freeze (--freeze "
                    f"{','.join(sorted(set(frozen) | set(trained)))}), or use the model's 16-bit weights: "
                    "--load_in_4bit quantizes its language model only")]
