"""The plan of a vision-language model, beside planning.plan's text path: its processor (the tokenizer, the image
processor with the pixel bounds the run sets, the chat template), its config, its parts sized and frozen on the meta
device, and what the plan's memory model and the run's MFU count of its vision tower.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from model_utils.config.presets import VISION_PRESETS, is_vision_preset
from model_utils.config.settings import TrainConfig
from model_utils.core.problems import Problem
from model_utils.data.vision.formats import VISION

IMAGE_SHARE_OF_BLOCK = 4  # by default an image is resized to at most a quarter of a block's tokens
EMBEDDED_VISION = "embedded-vision"
# A projector that trains keeps 8 bytes per patch and tower width beside a frozen tower (VisionPlan.activation_bytes)
TRAINED_PROJECTOR_BYTES = 8


@dataclass(frozen=True)
class VisionPlan:
    """What the run builds a vision-language model with, beside ModelPlan's language model."""

    processor: object  # the transformers processor, its image processor's pixel bounds set
    config: object  # the whole model's config (ModelPlan.config is its language model's)
    frozen: tuple[str, ...]  # the parts that do not train (models.vision.parts)
    part_params: dict  # each part's parameters
    flops: object  # models.vision.flops.VisionFlops
    pixels: tuple[int, int] | None  # (min, max) pixels an image is resized within; None: a fixed size
    pixels_choice: str  # how the bounds were set, for the plan's line
    checkpointing: bool = False  # --gradient_checkpointing: a tower that trains recomputes its blocks

    def describe(self) -> str:
        parts = ", ".join(f"{part.replace('_', ' ')} {count / 1e6:,.1f}M"
                          + (" (frozen)" if part in self.frozen else "") for part, count in self.part_params.items())
        return f"vision-language model: {parts}; images {self.pixels_choice}"

    def activation_bytes(self, micro: int, seq_len: int, bf16: bool) -> float:
        """What the tower and the projector keep for the backward pass in a micro-batch whose blocks were all image
        tokens (the most it can hold), counted per patch (merge² of them make an image token) in 16-bit (twice in
        fp32), h the tower's width and I its MLP's: a trained block keeps 32·h + 8·I bytes (its norms' fp32 inputs,
        the q, k, v and their per-head copies, the gated MLP's four tensors of width I), a checkpointed one its input,
        2·h (its working set is recomputed at the end of the backward pass, after the language model's activations
        are freed), and the rotary cos and sin in fp32 that every block reads; a frozen tower keeps nothing
        (models.vision.parts.keep_frozen_tower_out_of_autograd); a projector that trains keeps 8·h (its norm's fp32
        input and its MLP's two inputs), 12·h beside a tower that trains (its norm's 16-bit input and output too).
        tests/unit/models/test_vision_models.py holds these counts against what a forward leaves alive."""
        hidden, inter, layers, merge = self._tower_widths()
        tower_trains = "vision_tower" not in self.frozen
        per_patch = 0 if "projector" in self.frozen else (TRAINED_PROJECTOR_BYTES + 4 * tower_trains) * hidden
        if tower_trains:
            heads = getattr(self.config.vision_config, "num_heads", None) or 16
            per_patch += layers * (2 * hidden if self.checkpointing else 32 * hidden + 8 * inter)
            per_patch += 2 * 4 * hidden // heads  # the rotary cos and sin, fp32, that every block reads
        return per_patch * micro * seq_len * merge ** 2 * (1 if bf16 else 2)

    def _tower_widths(self) -> tuple[int, int, int, int]:
        """The tower's width h, its MLP's I, its blocks and its spatial merge (patches per image token: merge²)."""
        vision = self.config.vision_config
        hidden = getattr(vision, "hidden_size", 0) or getattr(vision, "embed_dim", 0)
        inter = getattr(vision, "intermediate_size", None) or int(getattr(vision, "mlp_ratio", 4) * hidden)
        layers = getattr(vision, "depth", None) or getattr(vision, "num_hidden_layers", 1)
        return hidden, inter, layers, getattr(vision, "spatial_merge_size", 1) or 1

    def block_bytes(self, micro: int, seq_len: int, bf16: bool) -> float:
        """One tower block's working set over such a micro-batch (32·h + 8·I bytes per patch in 16-bit, as
        activation_bytes counts a trained block): what a forward without gradients (evaluation) holds of the tower at
        once."""
        hidden, inter, _, merge = self._tower_widths()
        return (32 * hidden + 8 * inter) * micro * seq_len * merge ** 2 * (1 if bf16 else 2)


def vision_defaults(cfg: TrainConfig) -> TrainConfig:
    """A vision preset without --dataset trains on the embedded images (data.vision.shapes), as a text preset does on
    the embedded corpus."""
    if is_vision_preset(cfg.model.model) and not cfg.data.dataset and not cfg.data.dummy_data:
        return cfg.with_flags(dataset=EMBEDDED_VISION)
    return cfg


def vision_data_format(data, source) -> str:
    """The data format of a vision-language model's run (VISION), its rows' layout checked from the columns
    (data.vision.formats.vision_format: a DataError names the data, the columns and the layouts)."""
    from model_utils.core.problems import Problem
    from model_utils.data.errors import DataError
    from model_utils.data.sft.formats import source_columns
    from model_utils.data.vision.formats import VISION_FORMATS, vision_format

    if data.data_format not in ("auto", *VISION_FORMATS):
        raise DataError(Problem("--data_format", data.data_format, "is not a layout of rows with images",
                                f"use auto, or one of {', '.join(VISION_FORMATS)} (docs/VISION.md)"))
    vision_format(source_columns(source, data), data.data_format, source.location)
    return VISION


def default_max_pixels(processor, seq_len: int) -> tuple[int | None, str]:
    """The most pixels an image keeps by default: a quarter of a block's tokens, within the processor's own bound."""
    from model_utils.data.vision.processor import image_pixels, pixels_per_token

    bounds, per_token = image_pixels(processor), pixels_per_token(processor)
    if bounds is None or per_token is None:
        return None, "at the image processor's fixed size"
    budget = per_token * max(seq_len // IMAGE_SHARE_OF_BLOCK, 1)
    if budget >= bounds[1]:
        return None, f"within the processor's {bounds[0]:,}-{bounds[1]:,} pixels"
    return budget, (f"resized to at most {budget:,} pixels ({budget // per_token:,} tokens, a quarter of --seq_len "
                    f"{seq_len}: --max_image_pixels sets it)")


def load_processor_for(cfg: TrainConfig):
    """The run's processor (a preset's built, a model's loaded) and its config's model type; raises ProcessorError."""
    from model_utils.data.vision.processor import load_processor, preset_processor

    name = cfg.model.model
    if is_vision_preset(name):
        return preset_processor()
    from transformers import AutoConfig

    return load_processor(name, getattr(AutoConfig.from_pretrained(name), "model_type", None))


def token_problems(config, processor, name: str) -> list[Problem]:
    """The image token the processor writes must be the one the model replaces with image features."""
    from model_utils.data.vision.processor import image_token

    token, token_id = image_token(processor)
    expected = getattr(config, "image_token_id", None)
    if expected is None:
        expected = getattr(config, "image_token_index", None)
    if expected is not None and expected != token_id and not hasattr(processor, "boi_token"):
        return [Problem("--model", name, f"its processor writes images as {token} (id {token_id}) and the model "
                        f"replaces id {expected} with image features", "use the processor saved with the model")]
    return []


def load_vision_model(cfg: TrainConfig, seq_len: int):
    """(tokenizer, ModelPlan with its VisionPlan, problems) of a vision-language --model: the processor, the config,
    the model on the meta device with its parts frozen (and LoRA's adapters on the language model), sized."""
    from model_utils.data.vision.processor import ProcessorError, image_pixels, set_image_pixels
    from model_utils.models.build import FlopsModel, decay_groups
    from model_utils.models.lora import LoraError, adapter_activations, apply_lora, parameter_counts
    from model_utils.models.memory import QuantizedBase
    from model_utils.models.quantization import quantized_sizes
    from model_utils.models.vision.build import language_model_layers, meta_vision_model, vision_model_config
    from model_utils.models.vision.flops import VisionFlops
    from model_utils.models.vision.parts import freeze, freeze_problems, parse_parts
    from model_utils.models.vision.quantized import stored_in_4bit, stored_part_problems
    from model_utils.planning.memory_model import ModelPlan

    name = cfg.model.model
    try:
        processor = load_processor_for(cfg)
    except (ProcessorError, OSError, ValueError) as e:
        return None, None, [Problem("--model", name, f"has no processor that loads here: {e}".split("\n")[0],
                                    f"use a vision preset ({', '.join(VISION_PRESETS)}) or a model directory holding its "
                                    "processor (preprocessor_config.json and the tokenizer)")]
    tokenizer = processor.tokenizer
    vision = cfg.vision
    default, choice = default_max_pixels(processor, seq_len)
    pixels = vision.max_image_pixels or default
    if not set_image_pixels(processor, pixels, vision.min_image_pixels):
        choice = "at the image processor's fixed size"
        if vision.max_image_pixels or vision.min_image_pixels:
            return tokenizer, None, [Problem("--max_image_pixels" if vision.max_image_pixels else "--min_image_pixels",
                                             vision.max_image_pixels or vision.min_image_pixels,
                                             f"{type(processor.image_processor).__name__} resizes every image to one "
                                             "size, so its tokens per image are fixed", "leave out the pixel bounds")]
    elif vision.max_image_pixels or vision.min_image_pixels:
        choice = f"resized within {image_pixels(processor)[0]:,}-{image_pixels(processor)[1]:,} pixels (the flags)"
    try:
        config = vision_model_config(name, processor, cfg.model.attention_dropout)
    except (OSError, ValueError) as e:
        return tokenizer, None, [Problem("--model", name, f"could not be loaded: {e}".split("\n")[0],
                                         "use a vision preset or a model directory with config.json")]
    lora = cfg.model.lora_settings()
    problems = token_problems(config, processor, name) + freeze_problems(vision.freeze, lora is not None)
    if problems:
        return tokenizer, None, problems
    frozen = parse_parts(vision.freeze, pretrained=not is_vision_preset(name))
    sized = meta_vision_model(config, frozen)
    part_params = freeze(sized, frozen)
    quantized = None
    if lora is not None and lora.load_in_4bit:  # QLoRA: the language model's linear layers in 4-bit
        problems = stored_part_problems(config, sized, frozen, name)
        if problems:
            return tokenizer, None, problems
        quantized = QuantizedBase(*quantized_sizes(sized, stored_in_4bit(config, sized)))
    if lora is not None:
        lora = dataclasses.replace(lora, vision_frozen=frozen)
        try:
            sized = apply_lora(sized, lora)
        except LoraError as e:
            return tokenizer, None, e.problems
    counts = parameter_counts(sized)
    text = config.get_text_config()
    layers = len(language_model_layers(sized))
    model = ModelPlan(
        tokenizer, text, counts.trainable + counts.frozen,
        param_groups=tuple(tuple(p.numel() for p in group) for group in decay_groups(sized.parameters())),
        checkpointable_layers=layers, flops=FlopsModel.from_config(text, part_params["language_model"], seq_len),
        frozen_params=counts.frozen, lora=lora,
        adapters=adapter_activations(sized, lora, layers) if lora is not None else None,
        largest_param=max(p.numel() for p in sized.parameters()), quantized=quantized,
        vision=VisionPlan(processor, config, frozen, part_params, VisionFlops.of(config, part_params, frozen),
                          image_pixels(processor), choice, cfg.model.gradient_checkpointing))
    return tokenizer, model, []


def describe_vision_data(plan, checked_rows: int, sampled_rows: int) -> tuple[str, int | None]:
    """The preflight's data line and training blocks of rows with images: from the packed cache where a run built it,
    else from the first rows: `checked_rows` of each split read as conversations with their images (every image file
    there and named by its row), `sampled_rows` of them encoded (their images processed) and packed for the estimate
    and the image tokens of an example (one whose image would be cut by --seq_len is a DataError naming its row)."""
    import tempfile
    from pathlib import Path

    from model_utils.data.blocks import held_out_count
    from model_utils.data.sft.cache import load_sft_splits, sft_cache_root, source_key
    from model_utils.data.sft.encode import encode_rows
    from model_utils.data.sft.formats import source_columns
    from model_utils.data.vision.cache import data_dir_of, open_vision, vision_cache_dir
    from model_utils.data.vision.encode import VisionEncoder
    from model_utils.data.vision.formats import row_messages, vision_format
    from model_utils.data.vision.images import ImageFiles
    from model_utils.data.vision.packing import pack_vision_examples
    from model_utils.data.vision.processor import image_token

    cfg, source, processor = plan.cfg.data, plan.data_source, plan.model.vision.processor
    cache = vision_cache_dir(sft_cache_root(cfg), source_key(source, cfg), processor, plan.seq_len, cfg.data_format,
                             cfg.train_on_prompts)
    if (cache / "meta.json").exists():
        data = open_vision(cache, processor, cfg.validation_fraction)
        return f"data: {data.description} (packed cache {cache})", len(data.train_ids)
    train, validation = load_sft_splits(source, cfg)
    fmt = vision_format(source_columns(source, cfg), cfg.data_format, source.location)
    with tempfile.TemporaryDirectory() as store:  # images a dataset holds itself, for the check only
        files = ImageFiles(data_dir_of(source), Path(store))
        for split, rows in (("train", train), ("validation", validation)):
            where = f"{source.location} ({split} split)"
            for number, row in enumerate(rows.select(range(min(checked_rows, len(rows)))) if rows is not None
                                         else (), start=1):
                for value in row_messages(row, fmt, number, where)[1]:
                    files.path_of(value, where, number)
        sample = train.select(range(min(sampled_rows, len(train))))
        encoder = VisionEncoder(processor, fmt, files, cfg.train_on_prompts, f"{source.location} (train split)")
        tokenizer = processor.tokenizer
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        stats = pack_vision_examples(encode_rows(sample, encoder, checked=True), plan.seq_len, pad, len(tokenizer),
                                     image_token(processor)[1], source.location).stats
    blocks = int(stats.blocks * len(train) / max(len(sample), 1))
    if validation is None:
        blocks -= held_out_count(blocks, cfg.validation_fraction)
    return (f"data: {source.location}: rows with images ({encoder.describe()}), {len(train):,} rows; the first "
            f"{len(sample)}: {stats.describe()}; ~{blocks:,} training blocks estimated"), blocks
