"""The model of a run: its transformers config (a preset of config/presets.py, or a pretrained model's), built from
random weights or loaded pretrained, its vocabulary checked against the tokenizer, the layers activation checkpointing
can recompute, its FLOPs per token (MFU), the GPU's peak, and the optimizer's parameter groups.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from model_utils.config.presets import PRESET_ARCHITECTURES, PRESETS, is_preset
from model_utils.core.problems import Problem
from model_utils.models.quantization import load_quantized, quantize_layers


def tokenizer_source(tokenizer: str | None, model: str) -> str | None:
    """What --tokenizer resolves to: the one given, else the pretrained model's own (a preset has none: the default)."""
    return tokenizer if tokenizer or is_preset(model) else model


def _round_up(n: int, multiple: int = 64) -> int:
    return (n + multiple - 1) // multiple * multiple


def model_config(name: str, tokenizer=None, attention_dropout: float | None = None, rope_scaling: str | None = None):
    """The transformers config for a preset, or the config of a pretrained model directory / hub id; with
    `attention_dropout`, that dropout in place of the model's own; with `rope_scaling` (--rope_scaling TYPE:FACTOR,
    as a checkpoint's manifest records it once the plan accepted it by `rope_problem`), its rotary embeddings scaled
    by FACTOR and its positions as many times more."""
    config = _model_config(name, tokenizer)
    if attention_dropout is not None:
        config.attention_dropout = attention_dropout
    if rope_scaling is not None:
        scale_rope(config, rope_scaling)
    return config


def scale_rope(config, rope_scaling: str) -> None:
    """--rope_scaling TYPE:FACTOR on `config` in place: transformers' rope_parameters of that type and factor from the
    model's own positions and theta, and FACTOR times the positions."""
    kind, _, factor = rope_scaling.partition(":")
    original = config.max_position_embeddings
    theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta", getattr(config, "rope_theta", 1e4))
    config.rope_parameters = {"rope_type": kind, "factor": float(factor), "rope_theta": theta,
                              "original_max_position_embeddings": original}
    config.max_position_embeddings = int(original * float(factor))


def rope_problem(config, rope_scaling: str) -> Problem | None:
    """Why --rope_scaling cannot apply to this model: it scales its RoPE already (Llama 3.1's llama3 type, a YaRN
    config), which this flag would replace rather than extend."""
    current = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
    if current != "default":
        return Problem("--rope_scaling", rope_scaling, f"the model scales its rotary embeddings already (rope_type "
                       f"{current!r}, {config.max_position_embeddings:,} positions), which this would replace",
                       "set rope_parameters in the model's config.json to the scaling wanted, and leave out "
                       "--rope_scaling")
    return None


def _model_config(name: str, tokenizer=None):
    from transformers import AutoConfig, LlamaConfig, Qwen3Config

    if is_preset(name):
        params = dict(PRESETS[name.lower()])
        if params["vocab_size"] is None:
            # Sized to the tokenizer, rounded up to a multiple of 64 for efficient matrix shapes.
            params["vocab_size"] = _round_up(len(tokenizer))
        if tokenizer is not None:
            # The special ids of the tokenizer the preset trains with, so that an export's generate() stops at its
            # end of document (Qwen's own ids stand only where no tokenizer is known).
            params["eos_token_id"] = tokenizer.eos_token_id
            params["bos_token_id"] = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
            params["pad_token_id"] = tokenizer.pad_token_id
        architecture = {"llama": LlamaConfig}.get(PRESET_ARCHITECTURES.get(name.lower()), Qwen3Config)
        return architecture(**params)
    return AutoConfig.from_pretrained(name)


def check_vocab_covers_tokenizer(config, tokenizer, model_name: str, tokenizer_name: str | None):
    """A token id past the embedding table is a CUDA device assert mid-run; say it up front instead."""
    if len(tokenizer) > config.vocab_size:
        return Problem("--tokenizer", tokenizer_name or "default",
                       f"has {len(tokenizer)} tokens but model {model_name} embeds only {config.vocab_size}",
                       "use the model's own tokenizer, or a preset (whose vocabulary covers the default tokenizer), "
                       "or resize the model's embeddings before training")
    return None


def build_model(name: str, config, dtype, attn_implementation: str, gradient_checkpointing: bool,
                checkpointed_layers: int | None = None, quantization=None, device=None):
    """Random-init preset (pretraining) or `from_pretrained` (continued training). Under ZeRO-3 the caller enters
    `deepspeed.zero.Init` (through HfDeepSpeedConfig) so parameters are partitioned as they are created. With
    `gradient_checkpointing`, the first `checkpointed_layers` decoder layers recompute (None: all). `quantization`
    (models.quantization.Quantization, QLoRA): the linear layers in 4-bit on `device`, the rest in its compute dtype
    (built whole: ZeRO-3 partitions a 4-bit model at deepspeed.initialize, as transformers loads one outside
    zero.Init)."""
    from transformers import AutoModelForCausalLM

    if quantization is not None and not is_preset(name):
        model = load_quantized(name, config, quantization, device, attn_implementation)
    elif is_preset(name):
        model = AutoModelForCausalLM.from_config(config, dtype=quantization.compute_dtype if quantization else dtype,
                                                 attn_implementation=attn_implementation)
        if quantization is not None:
            quantize_layers(model, quantization, device)
    else:  # the config preflight already loaded: no second fetch of config.json
        model = AutoModelForCausalLM.from_pretrained(name, config=config, dtype=dtype,
                                                     attn_implementation=attn_implementation)
    if gradient_checkpointing:
        enable_activation_checkpointing(model)
        if checkpointed_layers is not None:
            for layer in checkpointable_layers(model)[checkpointed_layers:]:
                layer.gradient_checkpointing = False  # transformers reads the flag at each call
    model.config.use_cache = False
    return model


def enable_activation_checkpointing(model) -> None:
    """Every decoder layer recomputes its activations in the backward pass (torch's non-reentrant checkpoint), through
    transformers' activation_checkpointing_enable (5.25 on), or gradient_checkpointing_enable, its older name."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def checkpointable_layers(model) -> list:
    """The model's decoder layers that transformers checkpoints one by one (GradientCheckpointingLayer), in order:
    --checkpointed_layers counts these. (The compiled layers are the base model's `layers`:
    models.speed._decoder_layers.)"""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [module for module in model.modules() if isinstance(module, GradientCheckpointingLayer)]


def masks_documents_by_position(config) -> bool:
    """Whether transformers' causal LM for this config builds its attention mask with masking_utils'
    create_causal_mask, which masks attention to each document when the position ids restart (--document_mask)."""
    import importlib

    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError:
        return False
    return hasattr(importlib.import_module(model_class.__module__), "create_causal_mask")


def head_dim(config) -> int:
    """Per-head dimension: the config's `head_dim` (Qwen3 sets it) or hidden_size / num_attention_heads; 0 for a model
    without attention heads (Mamba, RWKV)."""
    heads = getattr(config, "num_attention_heads", None)
    return getattr(config, "head_dim", None) or (config.hidden_size // heads if heads else 0)


@dataclass
class FlopsModel:
    """Training FLOPs per token, by the PaLM convention: 6N + 12·L·H·Q·T.

    N counts every matrix parameter a token goes through, the LM head included and the input embedding (a lookup)
    excluded. The attention term counts QK^T and AV for the full (unmasked) T x T square, forward and backward;
    torchtitan uses 6·L·H·Q·T (the causal half). Both are reported. Where attention stays within documents
    (--document_mask) each document is its own square: `flops` takes the sum of their areas.
    """

    non_embedding_params: int
    num_layers: int
    num_heads: int
    head_dim: int
    seq_len: int

    @classmethod
    def from_config(cls, config, num_params: int, seq_len: int):
        embed = config.vocab_size * config.hidden_size
        lm_head = config.vocab_size * config.hidden_size
        n = num_params - embed + (lm_head if getattr(config, "tie_word_embeddings", False) else 0)
        heads = getattr(config, "num_attention_heads", None) or 0  # none: an attention-free model (Mamba)
        return cls(n, config.num_hidden_layers, heads, head_dim(config), seq_len)

    def per_token(self, attention_factor: int = 12) -> float:
        """For a token of a block attended across documents: its attention square is the block's, T x T."""
        return self.flops(self.seq_len, self.seq_len ** 2, attention_factor) / self.seq_len

    def flops(self, tokens: float, attention_area: float, attention_factor: int = 12) -> float:
        """FLOPs of `tokens` tokens whose attention squares (one per block, or one per document within a block) sum
        to `attention_area` query-key pairs."""
        attention = attention_factor * self.num_layers * self.num_heads * self.head_dim * attention_area
        return 6 * self.non_embedding_params * tokens + attention


# Dense bf16 tensor-core peak (no sparsity), TFLOP/s, by device name substring; the first match wins.
GPU_PEAK_BF16_TFLOPS = [
    ("H200", 989.0), ("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.0), ("GH200", 989.0),
    ("B200", 2250.0), ("GB200", 2500.0), ("B300", 2250.0), ("GB300", 2500.0),
    ("A100", 312.0), ("A10G", 70.0), ("A10", 125.0), ("L40S", 362.0), ("L40", 181.0), ("L4", 121.0),
]


def gpu_peak_tflops(device_name: str) -> float | None:
    override = os.environ.get("GPU_PEAK_TFLOPS")
    if override:
        return float(override)
    for key, peak in GPU_PEAK_BF16_TFLOPS:
        if key in device_name:
            return peak
    return None


def decay_groups(parameters) -> tuple[list, list]:
    """nanoGPT's grouping of the trainable parameters: weight decay on matrices (and embeddings), none on norms and
    biases. ZeRO-3 parameters are empty placeholders: their real shape is ds_shape. The optimizer sees the groups in
    this order (a partial offload keeps the first of its sub-groups on the GPU)."""
    trainable = [p for p in parameters if p.requires_grad]
    matrix = [len(getattr(p, "ds_shape", p.shape)) >= 2 for p in trainable]
    return [p for p, m in zip(trainable, matrix) if m], [p for p, m in zip(trainable, matrix) if not m]
