"""Hugging Face Trainer's flag names as newcomers type them (transformers' TrainingArguments and its run_clm example,
TRL's SFTConfig and ModelConfig). Each is accepted where it means exactly one of this trainer's flags, or asks for
what this trainer always does; every other one is refused with the flag to use and how the two differ.

flags.py puts them on the command line (hidden from --help), so a --config file takes them too; docs/CONFIGURATION.md
lists the same table (tests/unit/config/test_hf_names.py holds the two equal). Names the two trainers share
(--learning_rate, --max_steps, --seed, --gradient_accumulation_steps, --warmup_steps, --gradient_checkpointing,
--resume_from_checkpoint, --dataset_config_name, --attn_implementation, --lora_alpha, ...) are this trainer's own flags.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass


@dataclass(frozen=True)
class Alias:
    """The same setting under Trainer's name: `--NAME V` is `--flag V`."""

    flag: str
    same: str  # what both mean
    steps_or_ratio: bool = False  # Trainer reads a value below 1 as a ratio of the run's steps: refused here


@dataclass(frozen=True)
class Always:
    """What this trainer always does: accepted alone or with a true value; a false value is refused with `instead`."""

    what: str
    instead: str


@dataclass(frozen=True)
class Refused:
    """A setting that means something else here: refused, naming the flag to use."""

    flag: str
    differs: str
    fix: str


DS_CONFIG_FIX = "copy ds_config.json, change it there and pass --ds_config FILE (docs/CONFIGURATION.md)"

HF_NAMES: dict[str, Alias | Always | Refused] = {
    # ---- accepted: the same meaning
    "model_name_or_path": Alias("model", "a Hugging Face model directory or hub id, trained on from its weights "
                                         "(--model also takes the presets)"),
    "deepspeed": Alias("ds_config", "the DeepSpeed config file; bare, as DeepSpeed's launcher passes it "
                                    "(--deepspeed --deepspeed_config FILE), it changes nothing"),
    "num_train_epochs": Alias("num_epochs", "passes over the training data, fractions allowed (with --max_steps too "
                                            "it is refused, where Trainer lets --max_steps win)"),
    "logging_steps": Alias("log_interval", "log every N steps", steps_or_ratio=True),
    "eval_steps": Alias("eval_interval", "evaluate every N steps", steps_or_ratio=True),
    "save_steps": Alias("checkpoint_freq", "save a checkpoint every N steps", steps_or_ratio=True),
    "save_total_limit": Alias("keep_last_checkpoints", "the newest N checkpoints kept, older ones deleted; 0 keeps "
                                                       "all"),
    "max_seq_length": Alias("seq_len", "tokens per sequence a step trains on; a longer example is cut to it"),
    "max_length": Alias("seq_len", "TRL's name for the same: tokens per sequence, examples cut to it"),
    "block_size": Alias("seq_len", "run_clm's name for the same: text concatenated and cut into blocks of N tokens"),
    "dataset_name": Alias("dataset", "the dataset's hub name (--dataset also takes files and directories)"),
    "train_file": Alias("dataset", "run_clm's training file (--dataset takes any file or directory of data)"),
    "dataset_text_field": Alias("text_column", "the column holding the text"),
    "preprocessing_num_workers": Alias("num_proc", "processes that tokenize the data (datasets.map)"),
    "dataset_num_proc": Alias("num_proc", "TRL's name for the same: processes that tokenize the data"),
    "lora_r": Alias("lora_rank", "TRL's LoRA rank"),
    # ---- accepted: what this trainer always does
    "do_train": Always("this trainer always trains", "--preflight checks everything and trains nothing"),
    "do_eval": Always("every run evaluates at its end (and every --eval_interval steps)",
                      "--eval_interval 0 evaluates only at the end"),
    "packing": Always("examples are always packed into blocks of --seq_len tokens",
                      "drop --packing: a block holds as many whole examples as fit"),
    "assistant_only_loss": Always("only the answers carry loss by default",
                                  "--train_on_prompts puts the loss on every token"),
    "completion_only_loss": Always("only the completions carry loss by default",
                                   "--train_on_prompts puts the loss on every token"),
    # ---- refused: another meaning here
    "per_device_train_batch_size": Refused(
        "micro_batch_size", "--micro_batch_size counts packed blocks of --seq_len tokens per GPU, not examples "
                            "(several short examples share a block)",
        "pass --micro_batch_size N (or auto, sized by the GPU's memory), or state the global batch in tokens with "
        "--global_batch_tokens"),
    "per_device_eval_batch_size": Refused(
        "eval_iters", "evaluation runs at the training micro-batch", "pass --eval_iters N for the micro-batches "
                                                                     "each evaluation reads"),
    "output_dir": Refused(
        "checkpoint_dir", "checkpoints and the final model are two settings: --checkpoint_dir holds the "
                          "checkpoints, metrics and logs, the final model goes to CHECKPOINT_DIR/hf",
        "pass --checkpoint_dir DIR (and --export_dir DIR for the final model elsewhere)"),
    "overwrite_output_dir": Refused(
        "checkpoint_dir", "a run whose --checkpoint_dir holds checkpoints resumes from the newest (--resume auto)",
        "pass a new --checkpoint_dir to start afresh (--resume never refuses a directory holding checkpoints)"),
    "logging_dir": Refused(
        "checkpoint_dir", "TensorBoard's events go to CHECKPOINT_DIR/tensorboard",
        "pass --checkpoint_dir DIR"),
    "run_name": Refused(
        "checkpoint_dir", "W&B names the run after the --checkpoint_dir folder",
        "pass --checkpoint_dir, or set WANDB_NAME"),
    "warmup_ratio": Refused(
        "warmup_steps", "the warm-up is a count of steps (by default 5% of --max_steps)",
        "pass --warmup_steps N"),
    "lr_scheduler_type": Refused(
        "ds_config", "the schedule is the DeepSpeed config's \"scheduler\" (ds_config.json: warm-up, then cosine)",
        DS_CONFIG_FIX),
    "optim": Refused("ds_config", "the optimizer is the DeepSpeed config's \"optimizer\" (torch's fused AdamW)",
                     DS_CONFIG_FIX),
    "weight_decay": Refused("ds_config", "it is the DeepSpeed config's optimizer.params.weight_decay", DS_CONFIG_FIX),
    "adam_beta1": Refused("ds_config", "it is the DeepSpeed config's optimizer.params.betas", DS_CONFIG_FIX),
    "adam_beta2": Refused("ds_config", "it is the DeepSpeed config's optimizer.params.betas", DS_CONFIG_FIX),
    "adam_epsilon": Refused("ds_config", "it is the DeepSpeed config's optimizer.params.eps", DS_CONFIG_FIX),
    "max_grad_norm": Refused("ds_config", "it is the DeepSpeed config's gradient_clipping", DS_CONFIG_FIX),
    "bf16": Refused(
        "ds_config", "precision is the DeepSpeed config's: ds_config.json trains in bf16 wherever the GPU has it "
                     "(\"bf16\": {\"enabled\": \"auto\"}), in fp32 on CPU",
        "drop --bf16 (the default --ds_config ds_config.json does it)"),
    "fp16": Refused(
        "ds_config", "precision is the DeepSpeed config's", "pass --ds_config configs/fp16.json (fp16 with dynamic "
                                                           "loss scaling)"),
    "dtype": Refused(
        "ds_config", "precision is the DeepSpeed config's (bf16 wherever the GPU has it)",
        "drop it, or pass --ds_config configs/fp16.json for fp16"),
    "torch_dtype": Refused(
        "ds_config", "precision is the DeepSpeed config's (bf16 wherever the GPU has it)",
        "drop it, or pass --ds_config configs/fp16.json for fp16"),
    "report_to": Refused(
        "wandb", "each metrics sink is its own switch; metrics.jsonl is always written",
        "pass --wandb for Weights & Biases; TensorBoard is on (--no-tensorboard turns it off)"),
    "torch_compile": Refused(
        "compile", "--compile auto compiles each decoder layer on GPUs, not the whole model",
        "drop it (--compile layers forces the compiled layers, --compile off turns them off)"),
    "eval_strategy": Refused(
        "eval_interval", "evaluation is by steps, and always at the end",
        "pass --eval_interval N (0: only at the end)"),
    "evaluation_strategy": Refused(
        "eval_interval", "evaluation is by steps, and always at the end",
        "pass --eval_interval N (0: only at the end)"),
    "save_strategy": Refused(
        "checkpoint_freq", "saves are by steps or minutes, and always at the end",
        "pass --checkpoint_freq N (0: only at the end and on a stop signal) or --checkpoint_minutes M"),
    "validation_split_percentage": Refused(
        "validation_fraction", "the held-out share is a fraction, not a percentage",
        "pass --validation_fraction 0.05 for 5%"),
    "use_peft": Refused(
        "lora_rank", "LoRA is on where --lora_rank is above 0", "pass --lora_rank 16 (or another rank)"),
}


def step_count(text: str) -> int:
    """A count of steps for a flag Trainer also reads as a ratio (a value below 1): the ratio is refused."""
    try:
        return int(text)
    except ValueError:
        pass
    try:
        ratio = 0 < float(text) < 1
    except ValueError:
        ratio = False
    if ratio:
        raise argparse.ArgumentTypeError(f"{text} is a ratio of the run's steps (Hugging Face Trainer's reading of a "
                                         "value below 1); here it is a whole number of steps")
    raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of steps")
