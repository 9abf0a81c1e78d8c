"""The command line: every settings field is a flag (`--name`, booleans as `--name/--no-name`), grouped by section,
with its field's help text; `parse_args` returns the TrainConfig and which flags were given.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing

from model_utils.config.settings import PARSERS, SECTIONS, TrainConfig


def _base_type(annotation):
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    return args[0] if args else annotation


def _add_flags(parser, section_class) -> None:
    hints = typing.get_type_hints(section_class)
    for f in dataclasses.fields(section_class):
        if f.metadata.get("internal") or f.metadata.get("section"):
            continue
        kind = _base_type(hints[f.name])
        kw = {"default": f.default, "help": f.metadata["help"].replace("%", "%%")}  # argparse formats help
        names = [f"--{f.name}", *f.metadata.get("aliases", ())]
        if kind is bool:
            parser.add_argument(*names, action=argparse.BooleanOptionalAction, dest=f.name, **kw)
        else:
            kind = PARSERS[f.metadata["parse"]] if "parse" in f.metadata else kind
            parser.add_argument(*names, type=kind, choices=f.metadata.get("choices"), dest=f.name, metavar=(
                None if f.metadata.get("choices") else f.name.upper()), **kw)


SECTION_TITLES = {"model": "model", "data": "data", "batch": "batch", "optim": "optimisation (overrides of the "
                  "DeepSpeed config)", "checkpoint": "checkpoints, resume and export", "logging": "evaluation and "
                  "logging", "speed": "speed options (GPU; docs/PERFORMANCE.md)",
                  "preference": "preference tuning (docs/PREFERENCE.md)"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="train_deepspeed.py",
        description="Train a causal language model with DeepSpeed. Settings that DeepSpeed owns live in ds_config.json.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    for name, section in SECTIONS.items():
        _add_flags(parser.add_argument_group(SECTION_TITLES[name]), section)
    _add_flags(parser, TrainConfig)  # the seed and the modes
    # DeepSpeed's launcher convention (`deepspeed train.py --deepspeed --deepspeed_config ds_config.json`, as
    # DeepSpeedExamples write it; deepspeed.add_config_arguments' flags): --deepspeed is accepted and changes nothing
    # (this trainer always uses DeepSpeed), and the launcher appends --local_rank, which the environment also holds.
    parser.add_argument("--deepspeed", action="store_true", help="Accepted for DeepSpeed's launcher convention; "
                                                                 "DeepSpeed is always used.")
    parser.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)
    return parser


LAUNCHER_ONLY_FLAGS = ("deepspeed", "local_rank")


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    values = vars(build_parser().parse_args(argv))
    for name in LAUNCHER_ONLY_FLAGS:
        values.pop(name, None)
    defaults = TrainConfig().flags()
    defaults.update(defaults.pop("speed"))
    explicit = frozenset(k for k, v in values.items() if v != defaults.get(k))
    return TrainConfig.from_flags(explicit=explicit, **values)
