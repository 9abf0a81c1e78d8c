"""Fine-tuning's schedule: --num_epochs as optimizer steps (and on resume), and the learning-rate defaults for a
pretrained model.

Epochs count what the data order (`data.blocks.BlockOrder`) visits: an epoch is `training_blocks // (world x
micro)` global micro-batches (the remainder of the permutation is left out of that epoch, as BlockOrder leaves it), and
an optimizer step is `accumulation` global micro-batches, so a step may straddle two epochs. E epochs are
ceil(E x micro-batches per epoch / accumulation) steps: the last step completes the last epoch. E may be fractional.

Resume: the data position (epoch, blocks consumed in it) saved with each checkpoint says where in the epochs the run
is, independent of the world size. `steps_to_finish` counts the micro-batches still to come from there, as BlockOrder
will visit them at the resumed run's batch, and adds their steps to the step reached: with an unchanged batch that is
the first run's count exactly, and with another world size or micro-batch the run still stops at the end of the same
epoch.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from fractions import Fraction

from model_utils.config.presets import is_preset
from model_utils.core.problems import ConfigError, Problem
from model_utils.core.repo import REPO_ROOT
from model_utils.core.user_code import is_user_function


def _global_micro_batches_per_epoch(training_blocks: int, world: int, micro: int) -> int:
    return training_blocks // (world * micro)


def epochs_problems(num_epochs: float | None, max_steps: int | None, training_blocks: int, world: int,
                    micro: int) -> list[Problem]:
    """--num_epochs must be positive, not given with an explicit --max_steps, and the data must fill a micro-batch on
    every rank."""
    if num_epochs is None:
        return []
    problems = []
    if not num_epochs > 0:
        problems.append(Problem("--num_epochs", num_epochs, "must be positive", "use e.g. 1, 3 or 0.5"))
    if max_steps:
        problems.append(Problem("--num_epochs", num_epochs, f"and --max_steps {max_steps} both set the length",
                                "give one of them"))
    if _global_micro_batches_per_epoch(training_blocks, world, micro) == 0:
        problems.append(Problem("--num_epochs", num_epochs, f"the data has {training_blocks} training blocks, fewer "
                                f"than one micro-batch on every rank ({micro} x {world} ranks)",
                                "use more data, a smaller seq_len or a smaller micro-batch"))
    return problems


def steps_for_epochs(num_epochs: float, training_blocks: int, world: int, micro: int, accumulation: int) -> int:
    """Optimizer steps that cover `num_epochs` passes over `training_blocks` at this batch (module docstring)."""
    per_epoch = _global_micro_batches_per_epoch(training_blocks, world, micro)
    return max(1, math.ceil(Fraction(str(num_epochs)) * per_epoch / accumulation))


def describe_epochs(num_epochs: float, steps: int, training_blocks: int, world: int, micro: int,
                    accumulation: int) -> str:
    """The batch line's epoch part, e.g. "2 epochs = 1,234 steps (617 micro-batches of 16 blocks per epoch, 1 per
    step)"."""
    per_epoch = _global_micro_batches_per_epoch(training_blocks, world, micro)
    left_out = training_blocks - per_epoch * world * micro
    return (f"{num_epochs:g} epoch{'s' if num_epochs != 1 else ''} = {steps:,} steps ({per_epoch:,} micro-batches of "
            f"{world * micro} blocks per epoch, {accumulation} per step"
            + (f"; {left_out} blocks left out of each epoch, different ones each time" if left_out else "") + ")")


def steps_to_finish(num_epochs: float, training_blocks: int, world: int, micro: int, accumulation: int, step: int,
                    epoch: int, blocks_consumed: int) -> int:
    """The step at which a run resumed at `step` and data position (`epoch`, `blocks_consumed`) completes
    `num_epochs`: the step reached plus the steps that the micro-batches still to come take at this batch. The
    micro-batches left in the current epoch are those BlockOrder still fits in it at this batch's size."""
    per_global = world * micro
    per_epoch = _global_micro_batches_per_epoch(training_blocks, world, micro)
    left_in_epoch = (training_blocks - blocks_consumed) // per_global
    target = Fraction(str(num_epochs)) - epoch
    if target <= 0:
        return step
    if target <= 1:  # the end lies in this epoch: at ceil(target x per_epoch) micro-batches from its start
        needed = max(0, math.ceil(target * per_epoch) - (per_epoch - left_in_epoch))
    else:
        needed = left_in_epoch + math.ceil((target - 1) * per_epoch)
    return step + math.ceil(needed / accumulation)


# --------------------------------------------------------------------------------------------------------------------
# Defaults for fine-tuning a pretrained model
# --------------------------------------------------------------------------------------------------------------------
FULL_FINE_TUNING_LR = 2e-5  # TRL SFTConfig.learning_rate (it replaces TrainingArguments' 5e-5); Stanford Alpaca's too
LORA_LR = 2e-4  # QLoRA (Dettmers et al. 2023, appendix): 2e-4 up to 13B (1e-4 above); TRL's PEFT example: 2e-4
PREFERENCE_LR = 1e-6  # TRL DPOConfig.learning_rate (CPOConfig's and ORPOConfig's too)
# LoRA on pairs: TRL's rate for full tuning times the ratio the fine-tuning rates above keep between LoRA and full
PREFERENCE_LORA_LR = PREFERENCE_LR * LORA_LR / FULL_FINE_TUNING_LR
WARMUP_RATIO = 0.03  # Stanford Alpaca's recipe (--warmup_ratio 0.03) and QLoRA's
MIN_WARMUP_STEPS = 2  # DeepSpeed's WarmupLR family warms up for at least 2 steps (lr_schedules: max(2, warmup_num_steps))
FINE_TUNING_WEIGHT_DECAY = 0.0  # transformers TrainingArguments.weight_decay and Stanford Alpaca's recipe


@dataclass
class FineTuningDefaults:
    """The optimisation a pretrained model is fine-tuned with where the user did not set it (a preset trained from
    scratch keeps ds_config.json's)."""

    learning_rate: float
    warmup_steps: int
    weight_decay: float
    source: str
    filled: tuple[str, ...] = ()  # the flags these values were given to (those the user left unset)

    def describe(self) -> str:
        """The defaults in force: the learning rate and warm-up where the flags left them unset (`filled`; all of
        them where nothing says which), and the weight decay."""
        given = {"learning_rate": f"learning rate {self.learning_rate:g}",
                 "warmup_steps": f"{self.warmup_steps} warmup steps ({WARMUP_RATIO:.0%} of the run, at least "
                                 f"DeepSpeed's {MIN_WARMUP_STEPS})"}
        parts = [text for flag, text in given.items() if flag in self.filled or not self.filled]
        return (f"fine-tuning defaults: {', '.join(parts + [f'weight decay {self.weight_decay:g}'])} ({self.source}); "
                "set --learning_rate/--warmup_steps/ds_config's weight_decay to choose others")


def fine_tuning_defaults(total_steps: int, lora: bool, preference: bool = False) -> FineTuningDefaults:
    """The defaults for a fine-tuning run of `total_steps` steps, with LoRA adapters or all weights trained, on
    examples or on preference pairs."""
    warmup = max(MIN_WARMUP_STEPS, math.ceil(WARMUP_RATIO * total_steps))
    if preference:
        return FineTuningDefaults(PREFERENCE_LORA_LR if lora else PREFERENCE_LR, warmup, FINE_TUNING_WEIGHT_DECAY,
                                  "preference pairs: TRL DPOConfig's rate" + (", times LoRA's ratio to full "
                                                                              "fine-tuning" if lora else "")
                                  + ", Alpaca's warmup")
    if lora:
        return FineTuningDefaults(LORA_LR, warmup, FINE_TUNING_WEIGHT_DECAY,
                                  "LoRA: QLoRA's rate for models up to 13B, Alpaca/QLoRA warmup")
    return FineTuningDefaults(FULL_FINE_TUNING_LR, warmup, FINE_TUNING_WEIGHT_DECAY,
                              "TRL SFTConfig's rate, Stanford Alpaca's warmup, transformers' weight decay")


def takes_fine_tuning_defaults(cfg) -> bool:
    """A pretrained model (not a preset trained from scratch) with one of the repository's DeepSpeed configs (their
    learning rates are for pretraining from scratch; a config of the user's own keeps its values), whose learning
    rate or warmup the flags leave unset. A model of your own keeps the config's (it may well train from scratch)."""
    optim = cfg.optim
    repository_config = optim.ds_config_path.resolve().parent in (REPO_ROOT.resolve(), (REPO_ROOT / "configs").resolve())
    return (not is_preset(cfg.model.model) and not is_user_function(cfg.model.model) and repository_config
            and (optim.learning_rate is None or optim.warmup_steps is None))


def with_fine_tuning_defaults(cfg, total_steps: int):
    """(cfg with the fine-tuning defaults in its unset --learning_rate/--warmup_steps, the defaults or None where they
    do not apply: takes_fine_tuning_defaults)."""
    if not takes_fine_tuning_defaults(cfg):
        return cfg, None
    defaults = fine_tuning_defaults(total_steps, cfg.model.lora_rank > 0, cfg.preference.preference != "off")
    warmup = min(max(1, defaults.warmup_steps), max(1, total_steps - 1))  # WarmupDecayLR: at least 1, below the end
    defaults = dataclasses.replace(defaults, warmup_steps=warmup)
    changes = {}
    if cfg.optim.learning_rate is None:
        changes["learning_rate"] = defaults.learning_rate
    if cfg.optim.warmup_steps is None:
        changes["warmup_steps"] = warmup
    return cfg.with_flags(**changes), dataclasses.replace(defaults, filled=tuple(changes))


def apply_weight_decay(ds: dict, defaults: FineTuningDefaults | None) -> dict:
    """The DeepSpeed config with the fine-tuning defaults' weight decay (the project's ds_config.json is for
    pretraining from scratch); unchanged where no defaults apply."""
    if defaults is not None and isinstance(ds.get("optimizer"), dict):
        ds.setdefault("optimizer", {}).setdefault("params", {})["weight_decay"] = defaults.weight_decay
    return ds


@dataclass(frozen=True)
class EpochLength:
    """--num_epochs settled once the data is packed: the scheduler's total, the step the loop stops at, and the batch
    line's part."""

    total_steps: int  # num_epochs passes at this batch: the scheduler's total_num_steps
    stop_step: int  # where this run stops: total_steps, or on resume steps_to_finish from the data position
    description: str


def settle_epochs(num_epochs: float, training_blocks: int, world: int, micro: int, accumulation: int,
                  resumed: dict | None = None) -> EpochLength:
    """The length of a --num_epochs run; `resumed`: the checkpoint manifest it continues (step, data_position).
    Raises ConfigError where the data do not fill a micro-batch."""
    problems = epochs_problems(num_epochs, None, training_blocks, world, micro)
    if problems:
        raise ConfigError(problems)
    total = steps_for_epochs(num_epochs, training_blocks, world, micro, accumulation)
    stop = total
    if resumed is not None:
        position = resumed.get("data_position", {})
        stop = steps_to_finish(num_epochs, training_blocks, world, micro, accumulation, int(resumed["step"]),
                               int(position.get("epoch", 0)), int(position.get("blocks_consumed", 0)))
    description = describe_epochs(num_epochs, total, training_blocks, world, micro, accumulation)
    if stop != total:
        description += f"; this resumed run stops at step {stop:,}, the end of epoch {num_epochs:g} at its batch"
    return EpochLength(total, stop, description)
