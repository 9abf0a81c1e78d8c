"""Preference tuning's settings: which objective (DPO's sigmoid loss, IPO, SimPO, ORPO), its beta and SimPO's gamma,
their defaults, their checks, and what a resume may change.

The objectives are TRL's (trl 1.16): DPO and IPO are DPOTrainer's `loss_type="sigmoid"` and `"ipo"` against a
reference model; SimPO is CPOTrainer's `loss_type="simpo"` (`cpo_alpha=0`) and ORPO is ORPOTrainer's, both without a
reference model. Where this module says "the reference", it means the model the rewards are measured against: the
model at step 0.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from model_utils.core.problems import Problem

OBJECTIVES = ("dpo", "ipo", "simpo", "orpo")
OFF = "off"
REFERENCE_FREE = ("simpo", "orpo")  # the objectives that need no reference model

# --beta where it is left unset: DPOConfig's 0.1 for DPO and IPO (IPO's tau), ORPOConfig's 0.1 (ORPO's lambda), and
# for SimPO the SimPO paper's 2.0 (Meng et al. 2024: beta 2.0-2.5; CPOConfig's own 0.1 is its DPO-like default).
DEFAULT_BETA = {"dpo": 0.1, "ipo": 0.1, "simpo": 2.0, "orpo": 0.1}
DEFAULT_SIMPO_GAMMA = 0.5  # CPOConfig.simpo_gamma: the target reward margin


SEQUENCES_PER_PAIR = 2  # a block holds a pair's two sequences whole


def pair_block_len(max_length: int) -> int:
    """Positions per block for sequences of at most `max_length` tokens (--seq_len): any pair fits whole (a sequence
    of n tokens fills n - 1 positions)."""
    return SEQUENCES_PER_PAIR * max_length


def max_length_of(block_len: int) -> int:
    """The longest sequence, in tokens, that blocks of `block_len` positions are packed for (pair_block_len's
    inverse)."""
    return block_len // SEQUENCES_PER_PAIR


@dataclass(frozen=True)
class PreferenceSettings:
    """One run's objective with its values resolved (the defaults filled in)."""

    objective: str  # one of OBJECTIVES
    beta: float
    simpo_gamma: float | None = None  # SimPO only

    @property
    def needs_reference(self) -> bool:
        return self.objective not in REFERENCE_FREE

    @property
    def length_normalized(self) -> bool:
        """SimPO and ORPO score an answer by its mean log-probability per token; DPO and IPO by the sum."""
        return self.objective in REFERENCE_FREE

    def describe(self) -> str:
        parts = [f"preference: {self.objective}, beta {self.beta:g}"
                 + (" (ORPO's lambda)" if self.objective == "orpo" else "")]
        if self.simpo_gamma is not None:
            parts.append(f"gamma {self.simpo_gamma:g}")
        return ", ".join(parts)

    def as_manifest(self) -> dict:
        return asdict(self)


def preference_settings(cfg) -> PreferenceSettings | None:
    """The run's resolved settings from its configuration (TrainConfig), None where --preference is off."""
    section = cfg.preference
    if section.preference == OFF:
        return None
    beta = section.beta if section.beta is not None else DEFAULT_BETA[section.preference]
    gamma = None
    if section.preference == "simpo":
        gamma = section.simpo_gamma if section.simpo_gamma is not None else DEFAULT_SIMPO_GAMMA
    return PreferenceSettings(section.preference, float(beta), gamma)


def preference_problems(cfg) -> list[Problem]:
    """The settings' own values and their combinations with the rest of the run's flags."""
    section, data, model = cfg.preference, cfg.data, cfg.model
    problems = []
    if section.preference == OFF:
        given = [name for name in ("beta", "simpo_gamma") if name in cfg.explicit]
        if given:
            problems.append(Problem(f"--{given[0]}", cfg.flag(given[0]), "applies to preference tuning, which is off",
                                    f"add --preference dpo (or {', '.join(OBJECTIVES[1:])}), or drop --{given[0]}"))
        if data.data_format == "preference":
            problems.append(Problem("--data_format", "preference", "names preference pairs, and --preference is off",
                                    "add --preference dpo (or ipo, simpo, orpo) to tune on the pairs"))
        return problems
    objective = section.preference
    if section.beta is not None and not section.beta > 0:
        problems.append(Problem("--beta", section.beta, "must be positive",
                                f"use e.g. --beta {DEFAULT_BETA[objective]:g} ({objective}'s default)"))
    if section.simpo_gamma is not None and objective != "simpo":
        problems.append(Problem("--simpo_gamma", section.simpo_gamma, f"is SimPO's margin, and the objective is "
                                f"{objective}", "drop --simpo_gamma, or use --preference simpo"))
    if data.data_format not in ("auto", "preference"):
        problems.append(Problem("--data_format", data.data_format, f"--preference {objective} trains on pairs of a "
                                "better and a worse answer", "use --data_format preference (or auto: rows with chosen "
                                "and rejected columns); docs/PREFERENCE.md"))
    if data.train_on_prompts:
        problems.append(Problem("--train_on_prompts", True, "preference objectives score the answers only",
                                "drop --train_on_prompts"))
    if data.dummy_data:
        problems.append(Problem("--dummy_data", data.dummy_data, "random tokens hold no preference pairs",
                                "pass --dataset with pairs, or --dataset embedded-preference"))
    if data.streaming:
        problems.append(Problem("--streaming", True, "preference pairs are packed and scored by the reference once, "
                                "before training, which a stream read as training goes does not allow",
                                "drop --streaming (the pairs are cached once, as fine-tuning data are)"))
    if data.document_mask:
        problems.append(Problem("--document_mask", True, "pairs already attend within each sequence",
                                "drop --document_mask"))
    if model.sequence_parallel > 1:
        problems.append(Problem("--sequence_parallel", model.sequence_parallel, "preference tuning scores whole "
                                "sequences on one GPU (a pair is never split), which a sequence split across GPUs "
                                "would break", "drop --sequence_parallel (or use 1); shorten --seq_len or add "
                                "--gradient_checkpointing where a pair does not fit"))
    return problems


def preference_resume_problems(recorded: dict | None, settings: PreferenceSettings | None, checkpoint: str) -> list:
    """A checkpoint continues with the objective it was trained with: another objective, or preference tuning turned
    on or off, is refused (another beta or gamma is told at the resume: resume_changes)."""
    if recorded is None and settings is None:
        return []
    if settings is None:
        return [Problem("--preference", OFF, f"{checkpoint} was tuned with --preference {recorded['objective']}",
                        f"resume with --preference {recorded['objective']}, or start a new run in another "
                        "--checkpoint_dir")]
    if recorded is None:
        return [Problem("--preference", settings.objective, f"{checkpoint} was trained without preference tuning",
                        "resume it without --preference, or start the preference run in another --checkpoint_dir "
                        "from the exported model (--model CHECKPOINT_DIR/hf)")]
    if recorded["objective"] != settings.objective:
        return [Problem("--preference", settings.objective, f"{checkpoint} was tuned with --preference "
                        f"{recorded['objective']}", f"resume with --preference {recorded['objective']}, or start a "
                        "new run in another --checkpoint_dir")]
    return []


def resume_changes(recorded: dict | None, settings: PreferenceSettings | None) -> list[str]:
    """The values that differ from the checkpoint's (same objective), as 'name: old -> new'."""
    if not recorded or settings is None:
        return []
    now = settings.as_manifest()
    return [f"{name}: {recorded.get(name)} -> {now[name]}" for name in ("beta", "simpo_gamma")
            if recorded.get(name) != now[name]]
