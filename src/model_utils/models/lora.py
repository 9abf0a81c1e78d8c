"""LoRA (low-rank adapters, Hu et al. 2021) through `peft`: which layers get adapters, wrapping the model before
`deepspeed.initialize`, what the optimizer and the checkpoints hold, and the exports.

Wrapping: `apply_lora(model, settings)` freezes every weight of the model and adds a pair of low-rank matrices A (rank x
in) and B (out x rank, zero at the start, so the wrapped model starts as the pretrained one) beside each target layer;
its output becomes W x + (alpha / rank) B A dropout(x). Only A and B require gradients, so the optimizer's parameter
groups (`models.build.decay_groups`, which keeps `requires_grad` parameters) hold only them, and so do DeepSpeed's fp32
master weights and Adam moments.

Checkpoints: DeepSpeed's model file (`mp_rank_00_model_states.pt`) holds the module's whole state dict, frozen
weights included, unless `save_checkpoint(..., exclude_frozen_parameters=True)`; its optimizer files hold the trainable
parameters only. With frozen weights left out, a resume rebuilds them from the pretrained model (they never change) and
loads the checkpoint with `load_module_strict=False`; `checkpoint_options()` gives both arguments.

Exports: the adapter in PEFT's format (adapter_config.json, adapter_model.safetensors), which
`PeftModel.from_pretrained(base, path)` loads; with `export_merged`, also the model with B A added into its weights
(`merge_and_unload`), a plain transformers model that loads without peft.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path

from model_utils.config.settings import LoraSettings
from model_utils.core.problems import Problem
from model_utils.models.memory import AdapterActivations
from model_utils.models.quantization import (Quantization, leave_quantization_state_out, load_quantized, plain_tensor,
                                             record_base_quantization)

# Adapters on every linear layer of attention and MLP: Dettmers et al. 2023 (QLoRA, section 4) find that adapting
# all of them is what matches full fine-tuning; PEFT's own default (q_proj, v_proj) adapts two of seven.
LLAMA_LIKE_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
DEFAULT_TARGET_MODULES: dict[str, tuple[str, ...]] = {
    **{family: LLAMA_LIKE_TARGETS for family in ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2",
                                                 "gemma3_text", "gemma3")},
    # GPT-2's layers are Conv1D (weights stored in x out): c_attn (q, k, v together), c_proj (the attention's output
    # and the MLP's), c_fc (the MLP's input).
    "gpt2": ("c_attn", "c_proj", "c_fc"),
}
CONV1D_FAMILIES = ("gpt2",)
ALL_LINEAR = "all-linear"  # peft: every linear layer but the output head, for the families above none is listed
MODULES_TO_SAVE = "modules_to_save"  # peft's copies of the modules trained whole beside the adapters


def target_modules_for(config, settings: LoraSettings) -> list[str] | str:
    """The layer names to adapt in a model of this config: the settings' own, else its family's default, else
    peft's all-linear."""
    if settings.target_modules is not None:
        return list(settings.target_modules)
    return list(DEFAULT_TARGET_MODULES.get(getattr(config, "model_type", ""), ())) or ALL_LINEAR


def adaptable_layer_names(model) -> list[str]:
    """The last name component of every linear (or GPT-2 Conv1D) layer of the model, sorted: what
    --lora_target_modules can name."""
    import torch
    from transformers.pytorch_utils import Conv1D

    return sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                   if isinstance(module, (torch.nn.Linear, Conv1D)) and name})


def target_problems(model, targets: list[str] | str) -> list[Problem]:
    """Each named target that matches no linear layer of the model, with the names that would."""
    if targets == ALL_LINEAR:
        return []
    available = adaptable_layer_names(model)
    missing = [t for t in targets if t not in available]
    if not missing:
        return []
    return [Problem("--lora_target_modules", ",".join(missing), f"matches no linear layer of this "
                    f"{getattr(model.config, 'model_type', 'model')} model",
                    f"name layers among: {', '.join(available)}")]


def lora_config(model_config, settings: LoraSettings, model=None):
    """The peft LoraConfig for a model of `model_config`; a vision-language model's (settings.vision_frozen set) has
    its adapters on the language model's layers only and its other trained parts saved whole (models.vision.parts),
    which needs the `model` built."""
    from peft import LoraConfig, TaskType

    targets, whole = target_modules_for(model_config, settings), None
    if settings.vision_frozen is not None:
        from model_utils.models.vision.parts import language_model_linear_names, language_model_targets, part_modules

        if targets == ALL_LINEAR:
            targets = language_model_linear_names(model)
        whole = [name for part in ("projector", "vision_tower") if part not in settings.vision_frozen
                 for name in part_modules(model, part)] or None
        targets = language_model_targets(targets)
    return LoraConfig(task_type=TaskType.CAUSAL_LM, r=settings.rank, lora_alpha=settings.alpha,
                      lora_dropout=settings.dropout, target_modules=targets, modules_to_save=whole,
                      fan_in_fan_out=conv1d_layers(model_config, settings.load_in_4bit), bias="none")


def conv1d_layers(model_config, load_in_4bit: bool = False) -> bool:
    """Whether the adapted layers store their weights in x out (GPT-2's Conv1D): not once 4-bit layers (out x in)
    replace them."""
    return getattr(model_config, "model_type", "") in CONV1D_FAMILIES and not load_in_4bit


class LoraError(Exception):
    def __init__(self, problems: list[Problem]):
        self.problems = problems
        super().__init__("\n".join(str(p) for p in problems))


def apply_lora(model, settings: LoraSettings):
    """Wrap `model` (built, not yet given to deepspeed.initialize) with adapters; every other weight is frozen.
    Raises LoraError naming the settings at fault. With gradient checkpointing on, the inputs of the first layer
    require gradients, so the recomputed layers pass gradients back to the adapters."""
    from peft import get_peft_model

    problems = settings.problems()
    if not problems:
        problems = target_problems(model, target_modules_for(model.config, settings))
    if problems:
        raise LoraError(problems)
    wrapped = get_peft_model(model, lora_config(model.config, settings, model))
    checkpointing = getattr(model, "is_activation_checkpointing", None)  # transformers < 5.x: the older name
    if checkpointing if checkpointing is not None else getattr(model, "is_gradient_checkpointing", False):
        wrapped.enable_input_require_grads()
    return wrapped


def adapters_disabled(model):
    """A context in which a wrapped model runs as its frozen base (peft's disable_adapter): the reference of
    preference tuning with LoRA, no second copy of the model."""
    return model.disable_adapter()


def trainable_parameters(model) -> list:
    """The parameters the optimizer gets: those that require gradients (the adapters' under LoRA)."""
    return [p for p in model.parameters() if p.requires_grad]


@dataclass
class ParameterCounts:
    """Trainable and frozen parameters, for the memory estimate: a trainable parameter costs its weight, gradient
    and optimizer state (models.memory.model_state_bytes), a frozen one only its weight."""

    trainable: int
    frozen: int

    @property
    def total(self) -> int:
        return self.trainable + self.frozen

    def describe(self) -> str:
        return (f"{self.trainable / 1e6:,.2f}M trainable of {self.total / 1e6:,.1f}M parameters "
                f"({100 * self.trainable / max(self.total, 1):.2f}%)")


def parameter_counts(model) -> ParameterCounts:
    """Counts of a built model (ZeRO-3 placeholders counted by their real size, ds_numel)."""
    trainable = frozen = 0
    for p in model.parameters():
        n = getattr(p, "ds_numel", p.numel())
        if p.requires_grad:
            trainable += n
        else:
            frozen += n
    return ParameterCounts(trainable, frozen)


def meta_model(model_config, settings: LoraSettings | None):
    """A model of `model_config` on the meta device (nothing allocated or downloaded beyond the config), its tied
    weights tied, with these adapters (None: none): what the plan sizes and counts."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config)
        model.tie_weights()  # transformers 5.0 leaves a meta model's tied LM head untied until asked
        if settings is not None:
            model = apply_lora(model, settings)
    return model


def adapter_activations(model, settings: LoraSettings, layers: int):
    """models.memory.AdapterActivations of a wrapped model with `layers` decoder layers: its adapters' input widths and
    ranks summed over the model and shared out over the layers, those inside the layers' MLPs (a module named `mlp`,
    what models.sequence_parallel.tile_mlps tiles) also on their own."""
    from peft.tuners.lora import LoraLayer

    named = [(name.split("."), m) for name, m in model.named_modules() if isinstance(m, LoraLayer)]
    adapted, in_mlps = [m for _, m in named], [m for path, m in named if "mlp" in path]
    share = max(layers, 1)
    inputs, mlp_inputs = (sum(m.in_features for m in group) // share for group in (adapted, in_mlps))
    ranks, mlp_ranks = (sum(sum(m.r.values()) for m in group) // share for group in (adapted, in_mlps))
    return AdapterActivations(inputs, ranks, settings.dropout > 0, mlp_inputs, mlp_ranks)


def lora_parameter_counts(model_config, settings: LoraSettings | None) -> ParameterCounts:
    """The counts a model of `model_config` has with these adapters (None: no LoRA, everything trainable)."""
    return parameter_counts(meta_model(model_config, settings))


def checkpoint_options() -> tuple[dict, dict]:
    """(save_checkpoint's, load_checkpoint's) keyword arguments for a LoRA run: the frozen weights stay out of the
    checkpoint and come from the pretrained model on resume."""
    return {"exclude_frozen_parameters": True}, {"load_module_strict": False}


def lora_resume_problems(recorded: dict | None, settings: LoraSettings, checkpoint: str) -> list[Problem]:
    """A checkpoint continues only with the adapters it was trained with (the shapes and the layers)."""
    if recorded is None:
        return [Problem("--lora_rank", settings.rank, f"{checkpoint} was trained without LoRA",
                        "resume it without the LoRA options, or start a new run in another --checkpoint_dir")]
    before = LoraSettings.from_manifest(recorded)
    if before.load_in_4bit != settings.load_in_4bit:
        base = "a 4-bit base (--load_in_4bit)" if before.load_in_4bit else "a 16-bit base"
        return [Problem("--load_in_4bit", settings.load_in_4bit, f"{checkpoint} trained its adapters on {base}",
                        ("pass --load_in_4bit" if before.load_in_4bit else "drop --load_in_4bit")
                        + " to resume it, or start a new run in another --checkpoint_dir")]
    changed = [f"{name} {getattr(before, name)} -> {getattr(settings, name)}"
               for name in ("rank", "alpha", "target_modules") if getattr(before, name) != getattr(settings, name)]
    if not changed:
        return []
    return [Problem("--lora_rank", settings.rank, f"{checkpoint} was trained with other adapters ({'; '.join(changed)})",
                    "resume with the checkpoint's LoRA settings, or start a new run in another --checkpoint_dir")]


# --------------------------------------------------------------------------------------------------------------------
# Exports
# --------------------------------------------------------------------------------------------------------------------
def adapter_state_dict(model) -> dict:
    """The adapters' weights under PEFT's names (what adapter_model.safetensors holds)."""
    from peft import get_peft_model_state_dict

    return get_peft_model_state_dict(model)


def load_adapter_weights(model, state_dict: dict) -> None:
    """Put trained adapter weights (keys of the wrapped model's state dict, as DeepSpeed's zero_to_fp32 gives them,
    or PEFT's saved names) into a freshly wrapped model; every adapter weight must be given. The modules trained whole
    beside them (peft's modules_to_save: a vision-language model's projector that trains) come with them."""
    from peft import set_peft_model_state_dict

    trained = ("lora_", MODULES_TO_SAVE)
    own = {k for k in model.state_dict() if any(t in k for t in trained)}
    given = {k: v for k, v in state_dict.items() if any(t in k for t in trained)}
    if given and set(given) == own:
        model.load_state_dict(given, strict=False)
        return
    given = {k: v for k, v in given.items() if "lora_" in k}
    result = set_peft_model_state_dict(model, given)
    missing = [k for k in result.missing_keys if "lora_" in k]
    if missing or not given:
        raise RuntimeError(f"adapter weights missing for {missing[:3] or 'every adapter'}")


def export_lora(model, tokenizer, out_dir: Path, merged: bool = False, dtype=None,
                in_place: bool = False) -> dict[str, Path]:
    """Write the adapter (PEFT format) to out_dir/adapter and, with `merged`, the merged model to out_dir/merged, each
    with the tokenizer. `model`: the wrapped model (ZeRO-1/2: every rank holds it whole; export from rank 0). The
    merge works on a copy, so `model` keeps its adapters, unless `in_place` (a model that is not used afterwards: no
    second copy in memory). Returns {"adapter": path[, "merged": path]}."""
    import copy

    out_dir = Path(out_dir)
    written = {"adapter": out_dir / "adapter"}
    model.save_pretrained(written["adapter"])
    if tokenizer is not None:
        tokenizer.save_pretrained(written["adapter"])
    if merged:
        plain = (model if in_place else copy.deepcopy(model)).merge_and_unload()
        if dtype is not None:
            plain = plain.to(dtype)
        plain.config.use_cache = True
        written["merged"] = out_dir / "merged"
        plain.save_pretrained(written["merged"])
        if tokenizer is not None:
            tokenizer.save_pretrained(written["merged"])
    return written


def export_lora_checkpoint(base_model: str, settings: LoraSettings, fp32_state_dict: dict, tokenizer,
                           out_dir: Path, merged: bool = False, dtype=None) -> dict[str, Path]:
    """Offline export of a LoRA checkpoint (model_utils.export): the pretrained `base_model` wrapped again with the
    checkpoint's settings, the adapters' trained fp32 weights (zero_to_fp32's state dict) loaded, then `export_lora`.
    A QLoRA checkpoint's base is quantized again on the CPU, then dequantized (`export_qlora`)."""
    import torch

    if settings.load_in_4bit:
        base = quantized_base(base_model, settings)
    else:
        base = auto_model_class(settings).from_pretrained(base_model, dtype=torch.float32)
    model = apply_lora(base, settings)
    load_adapter_weights(model, fp32_state_dict)
    if settings.load_in_4bit:
        plain = {name: plain_tensor(tensor, torch.float32) for name, tensor in model.state_dict(keep_vars=True).items()}
        return export_qlora(model, plain, tokenizer, out_dir, merged, dtype)
    return export_lora(model, tokenizer, out_dir, merged, dtype, in_place=True)


def quantized_base(name: str, settings: LoraSettings):
    """The pretrained model `name` quantized on the CPU as a QLoRA run quantized it (fp32 compute): a vision-language
    model's language model only (models.vision.quantized)."""
    quantization = Quantization("fp32", 0)
    if settings.vision_frozen is not None:
        from transformers import AutoConfig

        from model_utils.models.vision.quantized import quantized_vision_model

        base = quantized_vision_model(name, AutoConfig.from_pretrained(name), quantization, "cpu")
    else:
        base = load_quantized(name, None, quantization, "cpu")
    leave_quantization_state_out(base)
    return base


def dequantized_copy(model, state: dict):
    """A LoRA model on the CPU over a 16-bit base: `model` (wrapped, its base in 4-bit) with the tensors of `state`, its
    state dict made plain (quantization.plain_tensor: the 4-bit weights dequantized), in their dtype. Built on the meta
    device and given those tensors (`assign`), so that only one copy of the weights is ever made."""
    import torch
    from peft import get_peft_model

    config = copy.deepcopy(model.get_base_model().config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the copy is a plain model
    adapters = copy.deepcopy(model.peft_config[model.active_adapter])
    adapters.fan_in_fan_out = conv1d_layers(config)
    dtype = next(t.dtype for t in state.values() if t.is_floating_point())
    with torch.device("meta"):
        plain = get_peft_model(auto_class_of(config).from_config(config, dtype=dtype), adapters)
    return holding(plain, state, config, "the dequantized model", assign=True)


def export_qlora(model, state: dict, tokenizer, out_dir: Path, merged: bool = False, dtype=None) -> dict[str, Path]:
    """A QLoRA model's exports: its adapters on the dequantized base (`dequantized_copy` of `state`), the adapter
    with a record of how its base was quantized (so that `python -m model_utils.generate` loads it quantized), and with
    `merged` the model with the adapters merged into the dequantized weights, which plain transformers loads."""
    plain = dequantized_copy(model, state)
    written = export_lora(plain, tokenizer, out_dir, merged, dtype, in_place=True)
    recorded = getattr(model.get_base_model().config, "quantization_config", None)
    skipped = (recorded if isinstance(recorded, dict) else recorded.to_dict()).get("llm_int8_skip_modules") \
        if recorded is not None else None
    record_base_quantization(written["adapter"], skipped)
    return written


@dataclass
class LoraSummary:
    """The run's LoRA line: the adapted layers and the parameter counts."""

    targets: list[str] | str
    counts: ParameterCounts
    settings: LoraSettings = field(default_factory=LoraSettings)

    def describe(self) -> str:
        targets = self.targets if isinstance(self.targets, str) else ",".join(self.targets)
        return (f"LoRA: rank {self.settings.rank}, alpha {self.settings.alpha:g}, dropout {self.settings.dropout:g} on "
                f"{targets}{' over a 4-bit base (QLoRA)' if self.settings.load_in_4bit else ''}; "
                f"{self.counts.describe()}")


def summary(model, settings: LoraSettings) -> LoraSummary:
    """The LoRA line of a wrapped model."""
    targets = target_modules_for(model.config, settings)
    if settings.vision_frozen is not None:
        targets = "the language model's " + (targets if isinstance(targets, str) else ",".join(targets))
    return LoraSummary(targets, parameter_counts(model), settings)


def unpartitioned_copy(config, settings, state_dict: dict):
    """A LoRA model of `config` on the CPU holding `state_dict` (a gathered ZeRO-3 model's, adapters included)."""
    import torch

    model = apply_lora(auto_model_class(settings).from_config(copy.deepcopy(config), dtype=torch.float32), settings)
    return holding(model, state_dict, config, "the gathered model")


def auto_model_class(settings: LoraSettings):
    """transformers' auto class of the adapted model: image-text-to-text for a vision-language model's settings."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if settings.vision_frozen is not None else AutoModelForCausalLM


def auto_class_of(config):
    """transformers' auto class of a model of `config`: image-text-to-text for a vision-language model's."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from model_utils.models.vision.build import is_vision_config

    return AutoModelForImageTextToText if is_vision_config(config) else AutoModelForCausalLM


def holding(model, state: dict, config, what: str, assign: bool = False):
    """`model` (wrapped) given the tensors of `state`, a whole state dict of the same wrapping (a tied LM head may be
    missing: tied again as `config` ties it); `assign`: the tensors themselves, not copies (a model on the meta
    device)."""
    missing, unexpected = model.load_state_dict(state, strict=False, assign=assign)
    if unexpected or [k for k in missing if "lm_head" not in k]:
        raise RuntimeError(f"{what} does not match its LoRA wrapping: missing {missing[:3]}, unexpected "
                           f"{unexpected[:3]}")
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    return model
