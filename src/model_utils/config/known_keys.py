"""Misspelt or unknown ds_config.json keys, found before DeepSpeed would stop on them: the top-level keys DeepSpeed's
constant modules name, and the fields of the pydantic models that validate its sections, with the nearest valid key.
"""

from __future__ import annotations

import importlib
import importlib.util

from model_utils.config.deepspeed import suggest
from model_utils.core.problems import Problem

# Section name -> DeepSpeed's pydantic model that validates it (unknown keys there are errors in DeepSpeed too).
SECTION_MODELS = {
    "zero_optimization": "deepspeed.runtime.zero.config:DeepSpeedZeroConfig",
    "bf16": "deepspeed.runtime.precision_config:DeepSpeedBF16Config",
    "fp16": "deepspeed.runtime.precision_config:DeepSpeedFP16Config",
    "tensorboard": "deepspeed.monitor.config:TensorBoardConfig",
    "wandb": "deepspeed.monitor.config:WandbConfig",
    "csv_monitor": "deepspeed.monitor.config:CSVConfig",
    "comms_logger": "deepspeed.comm.config:CommsLoggerConfig",
    "flops_profiler": "deepspeed.profiling.config:DeepSpeedFlopsProfilerConfig",
}


CONSTANT_MODULES = ["deepspeed.runtime.constants", "deepspeed.profiling.constants", "deepspeed.elasticity.constants",
                    "deepspeed.autotuning.constants", "deepspeed.runtime.swap_tensor.constants",
                    "deepspeed.runtime.data_pipeline.constants", "deepspeed.compression.constants",
                    "deepspeed.nebula.constants", "deepspeed.comm.constants", "deepspeed.runtime.zero.offload_config",
                    "deepspeed.runtime.activation_checkpointing.config"]


EXTRA_TOP_LEVEL = {"zero_optimization", "bf16", "fp16", "bfloat16", "tensorboard", "wandb", "csv_monitor", "comet",
                   "flops_profiler", "activation_checkpointing", "checkpoint", "data_types", "compile", "aio", "nebula",
                   "elasticity", "autotuning", "compression_training", "data_efficiency", "curriculum_learning",
                   "comms_logger", "amp", "torch_autocast", "weight_quantization", "hybrid_engine", "pipeline",
                   "sparse_attention", "timers", "tensor_parallel", "zenflow", "optimizer", "scheduler",
                   "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer", "steps_per_print",
                   "wall_clock_breakdown", "gradient_clipping", "prescale_gradients", "gradient_predivide_factor",
                   "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                   "memory_breakdown", "dump_state", "communication_data_type", "seq_parallel_communication_data_type",
                   "sequence_parallel_size", "disable_allgather", "graph_harvesting", "use_data_before_expert_parallelism"}


def _import(path: str):
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr) if attr else importlib.import_module(module)


def known_top_level_keys() -> set[str]:
    known = set(EXTRA_TOP_LEVEL)
    for name in CONSTANT_MODULES:
        try:
            module = _import(name)
        except ImportError:
            continue  # a DeepSpeed build without that feature
        known |= {v for k, v in vars(module).items() if k.isupper() and isinstance(v, str) and v.islower()}
    return known


def _nearest(key: str, valid) -> str:
    return suggest(key, valid, "remove it (see https://www.deepspeed.ai/docs/config-json/)")


def _model_keys(model) -> set[str]:
    keys = set()
    for name, f in model.model_fields.items():
        keys.add(name)
        if f.alias:
            keys.add(f.alias)
    return keys


def check_known_keys(raw: dict) -> list[Problem]:
    """Unknown or misspelt keys, top level and inside the sections DeepSpeed validates strictly."""
    from pydantic import BaseModel

    problems = []
    top = known_top_level_keys()
    for key in raw:
        if not key.startswith("_") and key not in top:
            problems.append(Problem(f"ds_config {key}", raw[key], "is not a DeepSpeed setting", _nearest(key, top)))
    for section, path in SECTION_MODELS.items():
        value = raw.get(section)
        if not isinstance(value, dict):
            continue
        try:
            model = _import(path)
        except (ImportError, AttributeError):
            continue
        valid = _model_keys(model)
        for key, sub in value.items():
            if key not in valid:
                problems.append(Problem(f"ds_config {section}.{key}", sub, f"is not a {section} setting",
                                        _nearest(key, valid)))
            elif section == "zero_optimization" and key in ("offload_optimizer", "offload_param") and isinstance(sub, dict):
                ann = model.model_fields[key].annotation
                inner = next((a for a in getattr(ann, "__args__", (ann,)) if isinstance(a, type) and issubclass(a, BaseModel)), None)
                if inner is not None:
                    inner_keys = _model_keys(inner)
                    for k2, v2 in sub.items():
                        if k2 not in inner_keys:
                            problems.append(Problem(f"ds_config zero_optimization.{key}.{k2}", v2,
                                                    f"is not a {key} setting", _nearest(k2, inner_keys)))
    return problems
