"""Checks of the settings that need nothing but the settings themselves (no torch, no data, no model): every problem
at once, each with its fix, before a process group or a GPU is asked for.
"""

from __future__ import annotations

import dataclasses
import os

from model_utils.config.preference import preference_problems
from model_utils.config.presets import is_preset
from model_utils.config.settings import SpeedConfig, TrainConfig
from model_utils.config.stages import read_stages
from model_utils.core.problems import Problem
from model_utils.core.repo import REPO_ROOT
from model_utils.core.user_code import is_user_function


def validate_args(cfg: TrainConfig) -> list[Problem]:
    """Checks that need nothing but the arguments themselves (fast: no imports of torch or data)."""
    problems = []

    def positive(name, allow_zero=False, optional=False):
        value = cfg.flag(name)
        if value is None and optional:
            return
        if value is None or value < 0 or (value == 0 and not allow_zero):
            bound = ">= 0" if allow_zero else ">= 1"
            problems.append(Problem(f"--{name}", value, f"must be an integer {bound}", f"pass --{name} with a value {bound}"))

    positive("max_steps")
    if cfg.batch.micro_batch_size != "auto":
        positive("micro_batch_size", optional=True)
    if cfg.model.checkpointed_layers != "all" and not cfg.model.gradient_checkpointing:
        problems.append(Problem("--checkpointed_layers", cfg.model.checkpointed_layers,
                                "chooses the layers --gradient_checkpointing recomputes, which is off",
                                "add --gradient_checkpointing, or leave --checkpointed_layers at all"))
    elif isinstance(cfg.model.checkpointed_layers, int):
        positive("checkpointed_layers", allow_zero=True)
    if cfg.model.offload_activations and not cfg.model.gradient_checkpointing:
        problems.append(Problem("--offload_activations", True, "offloads the inputs of the layers "
                                "--gradient_checkpointing recomputes, which is off", "add --gradient_checkpointing"))
    positive("global_batch_tokens", optional=True)
    positive("gradient_accumulation_steps", optional=True)
    positive("warmup_steps", allow_zero=True, optional=True)
    for name in ("eval_interval", "checkpoint_freq", "keep_last_checkpoints", "dummy_data", "max_documents",
                 "delayed_update_from_step", "stream_shuffle_blocks"):
        positive(name, allow_zero=True)
    positive("log_interval")
    positive("eval_iters")
    positive("max_bad_steps")
    if cfg.model.attention_dropout is not None and not 0.0 <= cfg.model.attention_dropout < 1.0:
        problems.append(Problem("--attention_dropout", cfg.model.attention_dropout, "must be a probability in [0, 1)",
                                "pass a value such as 0.1, or leave it out for the model's own"))
    if cfg.model.seq_len is not None and cfg.model.seq_len < 2:
        problems.append(Problem("--seq_len", cfg.model.seq_len, "a block needs at least 2 tokens to predict one",
                                "use --seq_len 256 or more"))
    if not cfg.checkpoint.checkpoint_minutes >= 0:
        problems.append(Problem("--checkpoint_minutes", cfg.checkpoint.checkpoint_minutes, "must be 0 (off) or a positive number "
                                "of minutes", "use e.g. --checkpoint_minutes 30"))
    if not cfg.data.data_stale_minutes > 0:
        problems.append(Problem("--data_stale_minutes", cfg.data.data_stale_minutes,
                                "must be a positive number of minutes", "use e.g. --data_stale_minutes 10"))
    if not 0.0 <= cfg.data.validation_fraction < 0.5:
        problems.append(Problem("--validation_fraction", cfg.data.validation_fraction, "must be in [0, 0.5)",
                                "use a small fraction such as 0.01"))
    if cfg.optim.learning_rate is not None and not cfg.optim.learning_rate > 0:
        problems.append(Problem("--learning_rate", cfg.optim.learning_rate, "must be positive", "use e.g. --learning_rate 3e-4"))
    if cfg.data.dataset and cfg.data.local_dataset == "true" and not os.path.exists(cfg.data.dataset):
        problems.append(Problem("--dataset", cfg.data.dataset, "LOCAL_DATASET=true but this path does not exist",
                                "fix the path, or set LOCAL_DATASET=false to load it from the hub"))
    if cfg.data.streaming and (cfg.data.dummy_data or cfg.data.max_documents):
        name = "--dummy_data" if cfg.data.dummy_data else "--max_documents"
        problems.append(Problem(name, cfg.flag(name[2:]), "cannot be combined with --streaming (a stream is read as "
                                "training goes, not cached)", f"drop one of {name} and --streaming"))
    if cfg.data.dataset and cfg.data.dummy_data:
        problems.append(Problem("--dummy_data", cfg.data.dummy_data, "cannot be combined with --dataset",
                                "drop one of --dummy_data and --dataset"))
    ds_path = cfg.optim.ds_config_path
    if not ds_path.is_file():
        problems.append(Problem("--ds_config", cfg.optim.ds_config, "file not found",
                                f"point DS_CONFIG/--ds_config at a DeepSpeed JSON file, e.g. {REPO_ROOT / 'ds_config.json'}"))
    if cfg.checkpoint.resume_from_checkpoint and not os.path.isdir(cfg.checkpoint.resume_from_checkpoint):
        problems.append(Problem("--resume_from_checkpoint", cfg.checkpoint.resume_from_checkpoint, "directory not found",
                                "pass a step-XXXXXXXX directory or a checkpoint directory holding `latest`"))
    if cfg.logging.wandb:
        import importlib.util

        if importlib.util.find_spec("wandb") is None:
            problems.append(Problem("--wandb", True, "the wandb package is not installed",
                                    "pip install wandb (or the project's `monitor` extra), or drop --wandb; "
                                    "WANDB_MODE=offline logs without network"))
    problems += speed_problems(cfg.speed)
    problems += fine_tuning_problems(cfg)
    problems += preference_problems(cfg)
    if cfg.checkpoint.resume == "never" and cfg.checkpoint.resume_from_checkpoint:
        problems.append(Problem("--resume", cfg.checkpoint.resume, "conflicts with --resume_from_checkpoint",
                                "drop one of the two"))
    return problems


def fine_tuning_problems(cfg: TrainConfig) -> list[Problem]:
    """LoRA's values and combinations, --num_epochs against --max_steps, and a pretrained model without data."""
    problems = []
    model, data = cfg.model, cfg.data
    settings = model.lora_settings()
    if model.lora_rank < 0:
        problems.append(Problem("--lora_rank", model.lora_rank, "must be 0 (off) or a positive rank",
                                "use e.g. --lora_rank 16, or leave it out for full fine-tuning"))
    elif settings is not None:
        problems += settings.problems()
    else:
        given = [name for name in ("lora_alpha", "lora_dropout", "lora_target_modules", "export_merged")
                 if name in cfg.explicit]
        if given:
            problems.append(Problem(f"--{given[0]}", cfg.flag(given[0]), "applies to LoRA, which is off "
                                    "(--lora_rank 0)", f"add --lora_rank 16 (or another rank), or drop --{given[0]}"))
    problems += qlora_problems(cfg)
    epochs = cfg.batch.num_epochs
    if epochs is not None:
        if not epochs > 0:
            problems.append(Problem("--num_epochs", epochs, "must be positive", "use e.g. 1, 3 or 0.5"))
        if "max_steps" in cfg.explicit:
            problems.append(Problem("--num_epochs", epochs, f"and --max_steps {cfg.batch.max_steps} both set the "
                                    "length", "give one of them"))
        if data.dummy_data:
            problems.append(Problem("--num_epochs", epochs, "counts passes over a dataset, and --dummy_data has "
                                    "none", "use --max_steps with --dummy_data"))
    own_model, own_data = is_user_function(model.model), is_user_function(data.dataset)
    if own_model and not own_data:
        problems.append(Problem("--dataset", data.dataset or (f"--dummy_data {data.dummy_data}" if data.dummy_data
                                                             else None),
                                f"a model of your own ({model.model}) reads a dataset of your own",
                                "pass --dataset FILE.py:FUNCTION, whose items your forward takes (docs/YOUR-MODEL.md)"))
    elif own_data and not own_model:
        problems.append(Problem("--dataset", data.dataset, f"a dataset of your own is read by a model of your own, "
                                f"and --model {model.model} is built in", "pass --model FILE.py:FUNCTION, or a "
                                "dataset the trainer reads (docs/DATA.md)"))
    elif not data.dataset and not data.dummy_data and not is_preset(model.model):
        problems.append(Problem("--dataset", None, f"a pretrained model ({model.model}) is fine-tuned on data you "
                                "choose; the embedded pretraining corpus is not taken by default",
                                "pass --dataset PATH_OR_HUB_NAME, or --dataset embedded-chat (chats built offline "
                                "from the standard library's docstrings), or --dataset embedded (its text corpus)"))
    if data.dataset and data.dataset.startswith("embedded") and data.dataset not in EMBEDDED_DATASETS \
            and not os.path.exists(data.dataset):
        problems.append(Problem("--dataset", data.dataset, "is not one of the embedded datasets",
                                f"use one of {', '.join(EMBEDDED_DATASETS)}, or a path or hub name"))
    return problems + curriculum_problems(cfg)


def curriculum_problems(cfg: TrainConfig) -> list[Problem]:
    """The stages as written (config.stages), and the settings they replace: the length, --data_args per stage for
    data not of your own."""
    stages, problems = read_stages(cfg.curriculum.stages)
    if not stages:
        return problems
    for flag in ("max_steps", "num_epochs"):
        if flag in cfg.explicit:
            problems.append(Problem(f"--{flag}", cfg.flag(flag), "sets the run's length, and the stages set it (the "
                                    "sum of theirs)", f"leave --{flag} out, or give each stage its steps or epochs"))
    own_data = is_user_function(cfg.data.dataset)
    for number, stage in enumerate(stages, start=1):
        if stage.data_args and not own_data:
            problems.append(Problem(f"stages[{number}] ({stage.name}).data_args", stage.data_args, "are for a "
                                    "dataset of your own (--dataset FILE.py:FUNCTION)", "leave the stage's data_args "
                                    "out: the stages share --dataset"))
        if stage.epochs is not None and cfg.data.dummy_data:
            problems.append(Problem(f"stages[{number}] ({stage.name}).epochs", stage.epochs, "counts passes over a "
                                    "dataset, and --dummy_data has none", "give the stage steps: N"))
    return problems


# The oldest bitsandbytes whose CPU backend runs NF4 with double quantization forward and backward and stores 4-bit
# weights in a float dtype (what ZeRO-3 partitions); pyproject.toml's qlora extra names the same floor.
BITSANDBYTES_FLOOR = "0.47.0"


def qlora_problems(cfg: TrainConfig, find_spec=None, version_of=None) -> list[Problem]:
    """--load_in_4bit: LoRA on, bitsandbytes installed at its floor, and none of the options a 4-bit base does not
    take (--sequence_parallel, --compile layers: docs/QLORA.md says why)."""
    model, speed = cfg.model, cfg.speed
    if not model.load_in_4bit:
        return []
    import importlib.util
    from importlib import metadata

    fix_install = f"pip install '.[qlora]' (bitsandbytes>={BITSANDBYTES_FLOOR}), or drop --load_in_4bit"
    problems = []
    if model.lora_rank <= 0:
        problems.append(Problem("--load_in_4bit", True, "quantizes the frozen base of a LoRA run, and LoRA is off "
                                "(--lora_rank 0): full fine-tuning cannot train 4-bit weights",
                                "add --lora_rank 16 (QLoRA), or drop --load_in_4bit"))
    if (find_spec or importlib.util.find_spec)("bitsandbytes") is None:
        problems.append(Problem("--load_in_4bit", True, "needs the bitsandbytes package, which is not installed",
                                fix_install))
    else:
        version = (version_of or metadata.version)("bitsandbytes")
        if release(version) < release(BITSANDBYTES_FLOOR):
            problems.append(Problem("--load_in_4bit", True, f"needs bitsandbytes {BITSANDBYTES_FLOOR} or newer, "
                                    f"{version} is installed", fix_install))
    if model.sequence_parallel > 1:
        problems.append(Problem("--sequence_parallel", model.sequence_parallel, "is not supported with a 4-bit base "
                                "(--load_in_4bit): not tested", "drop --sequence_parallel (one GPU holds each "
                                "sequence), or --load_in_4bit"))
    if speed.compile == "layers":
        problems.append(Problem("--compile", "layers", "is not supported with a 4-bit base (--load_in_4bit): the "
                                "compiled layers are tested with 16-bit weights only, the 4-bit layers run eager",
                                "use --compile auto (eager layers with --load_in_4bit) or off"))
    return problems


def release(version: str) -> tuple[int, ...]:
    """A release's leading numbers, to compare (0.47.0 < 0.50.2; 0.48.0.dev1 as 0.48.0)."""
    import re

    return tuple(int(part) for part in re.findall(r"\d+", re.match(r"[\d.]*", version).group())[:3])


# The datasets built offline (data.sources.resolve_source): the pretraining text corpus, the chat dataset and its
# preference pairs.
EMBEDDED_DATASETS = ("embedded", "embedded-chat", "embedded-preference", "embedded-vision")


# Environment variables a job script may set for the speed options: the trainer reads flags only, so a script that
# sets one would silently lose that setting (checked: a run refuses them, naming the flag to use).
RETIRED_SWITCHES = {"DSLM_COMPILE": "--compile", "DSLM_LIGER": "--liger_kernels", "DSLM_FLCE_CHUNK": "--flce_chunk_budget",
                    "DSLM_ACTIVATION_BUDGET": "--activation_budget", "DSLM_OVERFLOW_CHECK": "--overflow_check",
                    "DSLM_GRAD_NORM": None, "DSLM_ATTN": "--attention_kernel", "DSLM_SDPA": "--sdpa_backend"}


def speed_problems(speed: SpeedConfig, environ=os.environ) -> list[Problem]:
    """The speed options' values (argparse checks the command line; this also covers configs built in code) and any
    environment switch of the retired kind still set."""
    problems = []
    for f in dataclasses.fields(speed):
        value, choices = getattr(speed, f.name), f.metadata.get("choices")
        if choices and value not in choices:
            problems.append(Problem(f"--{f.name}", value, f"is not one of {', '.join(map(str, choices))}",
                                    f"use --{f.name} {f.default}"))
    if not 0.0 < speed.activation_budget <= 1.0:
        problems.append(Problem("--activation_budget", speed.activation_budget, "must be a fraction in (0, 1]",
                                "use --activation_budget 0.9 (1.0 recomputes nothing)"))
    for name in sorted(set(environ) & set(RETIRED_SWITCHES)):
        flag = RETIRED_SWITCHES[name]
        problems.append(Problem(name, environ[name], "the trainer reads its speed options from flags, not from the "
                                "environment", f"unset {name}" + (f" and pass {flag} instead" if flag else
                                                                  " (the option is gone: DeepSpeed's own norm runs)")))
    return problems
