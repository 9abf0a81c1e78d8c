"""QLoRA's frozen base (Dettmers et al. 2023): the model's linear layers stored in 4-bit NF4 by bitsandbytes, beside
LoRA's 16-bit adapters (models/lora.py); what the build, the memory estimate, the checkpoints and the exports need of it.

What is quantized: every linear layer but the output head, as transformers' bitsandbytes integration chooses
(`get_keys_to_not_convert`: the LM head, and the embedding tied to it, stay 16-bit; norms are not linear). Each weight
is cut into blocks of BLOCK values: 4 bits a value (the NF4 code) and one scale (absmax) per block, which double
quantization stores in 8 bits with one fp32 scale per NESTED_BLOCK of them: BYTES_PER_PARAM a parameter.

How: a pretrained model is loaded quantized by transformers (`from_pretrained(quantization_config=
BitsAndBytesConfig(...))`, `load_quantized`); a preset, built with random weights, has those layers replaced by
bitsandbytes' `Linear4bit` after its build, each weight quantized on the run's device (`quantize_layers`), as
transformers replaces them (`replace_with_bnb_linear`) before it loads a checkpoint's weights into them. Both mark the
model `is_loaded_in_4bit`, which peft reads to give the 4-bit layers its 4-bit LoRA layers.

The settings (`Quantization`): NF4 with double quantization; computed in the run's precision (bf16; fp16 on GPUs
without bf16; fp32 on CPU); the 4-bit values stored in bytes (uint8), or under ZeRO-3 in the run's float dtype, which
DeepSpeed partitions like any 16-bit weight (as Hugging Face's DeepSpeed ZeRO-3 QLoRA guide sets
`bnb_4bit_quant_storage=bfloat16`). A float storage always has the run's dtype: DeepSpeed casts float parameters of
any other to it, which would scramble the packed values.

Checkpoints hold none of the base: the 4-bit layers leave their quantization state out of `state_dict`
(`leave_quantization_state_out`), DeepSpeed leaves the frozen weights out (models.lora.checkpoint_options), and a
resume quantizes the same weights again, which gives the same 4-bit values (the quantization is deterministic). The
exports dequantize the base (`plain_tensor`) into a 16-bit copy holding the same adapters (models.lora.export_qlora).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from model_utils.core.problems import Problem
from model_utils.patches.bitsandbytes_cpu import keep_training_layout

QUANT_TYPE = "nf4"
BLOCK = 64  # values per absmax: bitsandbytes' default block for 4-bit weights
NESTED_BLOCK = 256  # absmaxes per fp32 scale under double quantization (bitsandbytes' fixed second level)
# 4 bits a value, an 8-bit absmax per block, an fp32 scale per NESTED_BLOCK absmaxes (QLoRA's 0.127 bits of constants)
BYTES_PER_PARAM = 0.5 + 1 / BLOCK + 4 / (BLOCK * NESTED_BLOCK)
PRECISION_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}  # the run's precision -> torch dtype
# What an adapter exported by a QLoRA run carries beside adapter_config.json: how its base was quantized, so that
# `python -m model_utils.generate` loads the base as the adapters were trained on it.
BASE_QUANTIZATION_FILE = "base_quantization.json"
LORA_PREFIX = "lora_"  # peft's adapter layers (lora_A, lora_B) are linear layers too; they stay 16-bit

# bitsandbytes' CPU backend warns, on CPUs with AVX512-BF16 where the `kernels` package is installed, that it could not
# fetch an inference kernel from the hub, in every process that imports it (peft imports it wherever it is installed).
# That is the warning of that logger; the trainer's 4-bit layers do not use the kernel (patches.bitsandbytes_cpu).
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)


@dataclass(frozen=True)
class Quantization:
    """How a run's base is quantized: the run's precision (bf16, fp16, fp32) and its ZeRO stage."""

    precision: str
    zero_stage: int

    @property
    def compute_dtype(self):
        import torch

        return getattr(torch, PRECISION_DTYPES[self.precision])

    @property
    def storage_dtype(self):
        import torch

        return self.compute_dtype if self.zero_stage == 3 else torch.uint8

    def bnb_config(self, skip_modules: list[str] | None = None):
        """transformers' BitsAndBytesConfig of these settings (what `from_pretrained` quantizes a model with);
        `skip_modules`: the modules kept out of 4-bit in place of transformers' default (the output head)."""
        from transformers import BitsAndBytesConfig

        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=QUANT_TYPE, bnb_4bit_use_double_quant=True,
                                  bnb_4bit_compute_dtype=self.compute_dtype,
                                  bnb_4bit_quant_storage=self.storage_dtype, llm_int8_skip_modules=skip_modules)

    def describe(self) -> str:
        storage = str(self.storage_dtype).removeprefix("torch.")
        return (f"base in 4-bit {QUANT_TYPE.upper()} with double quantization (bitsandbytes), computed in "
                f"{self.precision}, stored as {storage}" + (" (ZeRO-3 partitions it)" if self.zero_stage == 3 else ""))


# --------------------------------------------------------------------------------------------------------------------
# The base: which layers, built quantized
# --------------------------------------------------------------------------------------------------------------------
def quantizable_layers(model, keep=None) -> list[tuple[str, object]]:
    """(name, layer) of every linear (or GPT-2 Conv1D) layer a 4-bit base quantizes: all but the output head and
    peft's adapters, and of those only the ones whose dotted name `keep` accepts (None: all; a vision-language model's
    base quantizes its language model's only: models.vision.quantized.in_language_model). Works on a model built on the
    meta device, wrapped by peft or not."""
    import torch
    from transformers.pytorch_utils import Conv1D

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    head = base.get_output_embeddings()
    return [(name, module) for name, module in model.named_modules()
            if type(module) in (torch.nn.Linear, Conv1D) and module is not head and LORA_PREFIX not in name
            and (keep is None or keep(name))]


def quantized_sizes(model, keep=None) -> tuple[int, int]:
    """(parameters a 4-bit base stores in 4-bit, the largest such weight's): what the memory estimate counts."""
    sizes = [module.weight.numel() for _, module in quantizable_layers(model, keep)]
    return sum(sizes), max(sizes, default=0)


def quantize_layers(model, quantization: Quantization, device, keep=None) -> int:
    """Replace the quantizable layers of a built model (a preset's random weights; those `keep` accepts) by
    bitsandbytes' Linear4bit, each weight quantized on `device`; returns how many. GPT-2's Conv1D weights (in x out)
    are transposed first, as transformers' integration does."""
    from transformers.pytorch_utils import Conv1D

    import bitsandbytes as bnb
    layers = quantizable_layers(model, keep)
    for name, module in layers:
        weight = module.weight.data.t() if isinstance(module, Conv1D) else module.weight.data
        out_features, in_features = weight.shape
        layer = bnb.nn.Linear4bit(in_features, out_features, module.bias is not None, quantization.compute_dtype,
                                  compress_statistics=True, quant_type=QUANT_TYPE,
                                  quant_storage=quantization.storage_dtype, device="meta")
        layer.weight = bnb.nn.Params4bit(weight, requires_grad=False, compress_statistics=True, quant_type=QUANT_TYPE,
                                         quant_storage=quantization.storage_dtype, module=layer).to(device)
        if module.bias is not None:
            layer.bias = module.bias
        layer.source_cls = type(module)  # as transformers marks its 4-bit layers (the exports transpose Conv1D back)
        model.set_submodule(name, layer)
    model.is_loaded_in_4bit = True  # what transformers sets on a 4-bit model; peft reads it
    return len(layers)


def load_quantized(name: str, config, quantization: Quantization, device, attn_implementation: str = "sdpa",
                   auto_class=None, skip_modules: list[str] | None = None):
    """A pretrained model loaded with its quantizable layers in 4-bit on `device` (transformers quantizes each weight as
    it loads it); a checkpoint stored in 4-bit already loads with its own settings (prequantized_problems checks
    them). `auto_class`: transformers' auto class (None: AutoModelForCausalLM); `skip_modules`: the full names of the
    modules kept in the compute dtype, in place of transformers' default (the output head), as
    `BitsAndBytesConfig.llm_int8_skip_modules` (a vision-language model's tower, projector and head:
    models.vision.quantized.quantized_vision_model)."""
    from transformers import AutoModelForCausalLM

    stored = getattr(config, "quantization_config", None) if config is not None else None
    return (auto_class or AutoModelForCausalLM).from_pretrained(
        name, config=config, dtype=quantization.compute_dtype, attn_implementation=attn_implementation,
        device_map={"": device}, **({} if stored else {"quantization_config": quantization.bnb_config(skip_modules)}))


def leave_quantization_state_out(model) -> None:
    """The 4-bit layers' state_dict without their quantization state (absmax, the NF4 code, the double quantization's
    scales): a checkpoint holds what trains, the base is quantized again on resume. The packed weights stay in it (as
    frozen parameters, DeepSpeed leaves them out)."""
    import bitsandbytes as bnb

    def drop_quantization_state(module, state_dict, prefix, local_metadata):
        for key in [k for k in state_dict if k.startswith(prefix + "weight.")]:
            del state_dict[key]

    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            module.register_state_dict_post_hook(drop_quantization_state)


def prepare_for_training(model, log=None) -> None:
    """A 4-bit model as the trainer runs it: its layers keep their training layout on CPUs
    (patches.bitsandbytes_cpu) and leave their quantization state out of checkpoints."""
    keep_training_layout(model, log)
    leave_quantization_state_out(model)


# --------------------------------------------------------------------------------------------------------------------
# The exports: the base dequantized
# --------------------------------------------------------------------------------------------------------------------
def merged_dtype(precision: str):
    """The dtype of a QLoRA run's merged export: bf16, fp32 on CPU (the precision the run computed in, or bf16)."""
    import torch

    return torch.float32 if precision == "fp32" else torch.bfloat16


def plain_tensor(tensor, dtype):
    """A state dict entry as a `dtype` model holds it on the CPU: a 4-bit weight dequantized (a GPT-2 Conv1D's
    transposed back to in x out), any other floating tensor cast, the rest copied."""
    from transformers.pytorch_utils import Conv1D

    import bitsandbytes as bnb
    if isinstance(tensor, bnb.nn.Params4bit):
        weight = bnb.functional.dequantize_4bit(tensor.data, tensor.quant_state)
        if getattr(getattr(tensor, "module", None), "source_cls", None) is Conv1D:
            weight = weight.t()
        return weight.to("cpu", dtype).contiguous()
    return tensor.detach().to("cpu", dtype if tensor.is_floating_point() else None).clone()


def record_base_quantization(adapter_dir: Path, skip_modules: list[str] | None = None) -> Path:
    """Write how the base of an exported adapter was quantized beside it (BASE_QUANTIZATION_FILE); `skip_modules`:
    the modules its base kept out of 4-bit where not transformers' default (a vision-language model's)."""
    path = Path(adapter_dir) / BASE_QUANTIZATION_FILE
    recorded = {"load_in_4bit": True, "bnb_4bit_quant_type": QUANT_TYPE, "bnb_4bit_use_double_quant": True}
    if skip_modules:
        recorded["llm_int8_skip_modules"] = list(skip_modules)
    path.write_text(json.dumps(recorded, indent=2) + "\n")
    return path


def recorded_base_quantization(model_dir, compute_dtype):
    """The BitsAndBytesConfig an exported QLoRA adapter's base loads with (computed in `compute_dtype`), or None for
    any other model directory."""
    path = Path(model_dir) / BASE_QUANTIZATION_FILE
    if not path.is_file():
        return None
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(**json.loads(path.read_text()), bnb_4bit_compute_dtype=compute_dtype)


# --------------------------------------------------------------------------------------------------------------------
# A pretrained model that is quantized already
# --------------------------------------------------------------------------------------------------------------------
def prequantized_problems(config, model_name: str, load_in_4bit: bool, precision: str,
                          zero_stage: int) -> list[Problem]:
    """A pretrained model whose config.json holds a quantization_config: only a bitsandbytes 4-bit one trains here, as
    a QLoRA base, computed in the run's precision, and stored in bytes or in the run's float dtype."""
    recorded = getattr(config, "quantization_config", None)
    if recorded is None:
        return []
    recorded = recorded if isinstance(recorded, dict) else recorded.to_dict()
    method = recorded.get("quant_method", "unknown")
    if method != "bitsandbytes" or not recorded.get("load_in_4bit"):
        kind = "8-bit bitsandbytes" if recorded.get("load_in_8bit") else method
        return [Problem("--model", model_name, f"is stored quantized ({kind}), which this trainer does not train",
                        "use the model's 16-bit weights (with --lora_rank 16 --load_in_4bit for a 4-bit base)")]
    if not load_in_4bit:
        return [Problem("--load_in_4bit", False, f"{model_name} holds 4-bit bitsandbytes weights, which train only "
                        "as the frozen base of LoRA adapters", "add --lora_rank 16 --load_in_4bit, or use the "
                        "model's 16-bit weights")]
    wanted = PRECISION_DTYPES[precision]
    problems = []
    compute = str(recorded.get("bnb_4bit_compute_dtype", "float32")).removeprefix("torch.")
    if compute != wanted:
        problems.append(Problem("--model", model_name, f"computes its 4-bit layers in {compute} "
                                f"(bnb_4bit_compute_dtype in its config.json), this run in {precision}",
                                f"train in that precision ({'configs/fp16.json' if compute == 'float16' else 'bf16'} "
                                "on GPUs that have it), or use the model's 16-bit weights: --load_in_4bit quantizes "
                                "them for the run's precision"))
    storage = str(recorded.get("bnb_4bit_quant_storage", "uint8")).removeprefix("torch.")
    if storage != "uint8" and storage != wanted or zero_stage == 3 and storage != wanted:
        need = f"{wanted} (the run's precision)" if zero_stage == 3 else f"uint8 or {wanted}"
        problems.append(Problem("--model", model_name, f"stores its 4-bit values as {storage} "
                                f"(bnb_4bit_quant_storage), this run needs {need}: DeepSpeed "
                                + ("partitions only float parameters of the run's dtype" if zero_stage == 3 else
                                   "casts float parameters to the run's dtype"),
                                "use the model's 16-bit weights (--load_in_4bit quantizes them as the run needs)"
                                + (", or ZeRO-2 (ds_config.json)" if zero_stage == 3 and storage == "uint8" else "")))
    return problems
