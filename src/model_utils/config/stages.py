"""A curriculum: the run file's `stages:`, each a mapping read into a `Stage` here, checked before anything starts.

    stages:
      - {name: align, steps: 100, learning_rate: 1e-3, train: [projector], data_args: {task: captions}}
      - {name: language, epochs: 1, learning_rate: 2e-4, warmup_steps: 10, freeze: [encoder]}
      - {name: all, steps: 200, learning_rate: 5e-5, decay: cosine}

A stage's length is `steps` or `epochs` (passes over its data, turned into steps once the data are read); its
learning rate `learning_rate` (default: the optimizer's in ds_config.json), reached after `warmup_steps` and then held
(`decay: constant`) or brought to zero by the stage's end (`decay: linear` or `cosine`); what trains is `train:` (only
these) or `freeze:` (all but these), names of modules (dotted prefixes) or of the model's groups (train/stages.py
resolves them on the model); `data_args:` are merged over the run's --data_args for the stage's own data (a dataset
of your own). The stages run in order in one run and one checkpoint directory.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

from model_utils.core.problems import Problem

KEYS = ("name", "steps", "epochs", "learning_rate", "warmup_steps", "decay", "train", "freeze", "data_args")
DECAYS = ("constant", "linear", "cosine")
FIX_SHAPE = "write each stage as a mapping, e.g. {name: align, steps: 100, learning_rate: 1e-3, train: [projector]}"


@dataclass(frozen=True)
class Stage:
    """One stage of a curriculum, as written (its length in steps is the run's to settle: `epochs` need its data)."""

    name: str
    steps: int | None = None
    epochs: float | None = None
    learning_rate: float | None = None  # None: the optimizer's own
    warmup_steps: int = 0
    decay: str = "constant"
    train: tuple[str, ...] | None = None  # only these train; None: see freeze
    freeze: tuple[str, ...] = ()  # these do not train (with train None)
    data_args: dict | None = None  # merged over --data_args: the stage's own data

    def describe(self, steps: int) -> str:
        what = (f"trains {', '.join(self.train)}" if self.train is not None else
                f"freezes {', '.join(self.freeze)}" if self.freeze else "trains everything")
        rate = f"lr {self.learning_rate:g}" if self.learning_rate is not None else "the optimizer's lr"
        warmup = f" after {self.warmup_steps} warm-up steps" if self.warmup_steps else ""
        data = f"; its data_args {self.data_args}" if self.data_args else ""
        length = f"{steps} steps" + (f" ({self.epochs:g} epochs)" if self.epochs is not None else "")
        return f"stage {self.name}: {length}, {rate}{warmup}, {self.decay}; {what}{data}"


def read_stages(raw: list | None) -> tuple[tuple[Stage, ...], list[Problem]]:
    """The --stages list as Stages, and every problem found in it (each naming the stage and key)."""
    if raw is None:
        return (), []
    if not raw:
        return (), [Problem("stages", raw, "is an empty list", "give at least one stage, or leave stages out")]
    stages, problems, names = [], [], set()
    for number, entry in enumerate(raw, start=1):
        stage, found = _read_stage(number, entry)
        problems += found
        if stage is None:
            continue
        if stage.name in names:
            problems.append(Problem(f"stages[{number}].name", stage.name, "names an earlier stage too",
                                    "give every stage a name of its own"))
        names.add(stage.name)
        stages.append(stage)
    return tuple(stages), problems


def _read_stage(number: int, entry) -> tuple[Stage | None, list[Problem]]:
    where = f"stages[{number}]"
    if not isinstance(entry, dict):
        return None, [Problem(where, entry, f"is a {type(entry).__name__}, not a mapping", FIX_SHAPE)]
    problems = []
    for key in entry:
        if key not in KEYS:
            near = difflib.get_close_matches(str(key), KEYS, n=1)
            problems.append(Problem(f"{where}.{key}", entry[key], "is not a stage's key",
                                    f"did you mean {near[0]}?" if near else f"a stage's keys: {', '.join(KEYS)}"))
    name = str(entry.get("name") or f"stage{number}")
    where = f"stages[{number}] ({name})"
    steps, epochs = entry.get("steps"), entry.get("epochs")
    if (steps is None) == (epochs is None):
        problems.append(Problem(where, {k: entry.get(k) for k in ("steps", "epochs")},
                                "needs its length: steps or epochs, one of them",
                                "give steps: N (optimizer steps) or epochs: N (passes over its data)"))
    steps = _number(problems, where, "steps", steps, int)
    epochs = _number(problems, where, "epochs", epochs, float)
    rate = _number(problems, where, "learning_rate", entry.get("learning_rate"), float)
    warmup = _number(problems, where, "warmup_steps", entry.get("warmup_steps", 0), int, zero=True)
    decay = entry.get("decay", "constant")
    if decay not in DECAYS:
        problems.append(Problem(f"{where}.decay", decay, "is not a decay", f"write one of {', '.join(DECAYS)}"))
    if steps is not None and warmup is not None and warmup >= steps:
        problems.append(Problem(f"{where}.warmup_steps", warmup, f"is not below the stage's {steps} steps",
                                "warm up for fewer steps than the stage has"))
    train, freeze = entry.get("train"), entry.get("freeze")
    if train is not None and freeze is not None:
        problems.append(Problem(where, {"train": train, "freeze": freeze}, "gives both train and freeze",
                                "give train: (only these train) or freeze: (all but these), not both"))
    train, freeze = _names(problems, where, "train", train), _names(problems, where, "freeze", freeze)
    if train == ():
        problems.append(Problem(f"{where}.train", [], "trains nothing", "name what trains, or leave train out"))
    data_args = entry.get("data_args")
    if data_args is not None and not isinstance(data_args, dict):
        problems.append(Problem(f"{where}.data_args", data_args, "is not a mapping", "write data_args: {key: value}"))
        data_args = None
    if problems:
        return None, problems
    return Stage(name, steps, epochs, rate, warmup, decay, train, freeze or (), data_args), []


def _number(problems: list, where: str, key: str, value, kind, zero: bool = False):
    """A positive number (YAML reads 1e-3 as text: taken as a number here), or None with a problem."""
    if value is None:
        return None
    try:
        number = kind(float(value)) if kind is int and float(value).is_integer() else kind(value)
    except (TypeError, ValueError):
        number = None
    if number is None or isinstance(value, bool) or number < 0 or (number == 0 and not zero):
        problems.append(Problem(f"{where}.{key}", value, f"is not a {'non-negative' if zero else 'positive'} "
                                f"{'whole number' if kind is int else 'number'}", f"write {key}: "
                                f"{'0' if zero else '100' if kind is int else '1e-4'}"))
        return None
    return number


def _names(problems: list, where: str, key: str, value) -> tuple[str, ...] | None:
    if value is None:
        return None
    if isinstance(value, str):
        value = [part.strip() for part in value.split(",") if part.strip()]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        problems.append(Problem(f"{where}.{key}", value, "is not a list of names",
                                f"write {key}: [projector, decoder.layers.0] (module prefixes or your model's groups)"))
        return None
    return tuple(value)


def stage_bounds(stages: tuple[Stage, ...], steps_per_epoch: list[int]) -> list[tuple[int, int]]:
    """Each stage's (first step, last step + 1) in the run's steps: `steps`, or `epochs` x its data's steps per
    epoch (at least one step)."""
    bounds, start = [], 0
    for stage, per_epoch in zip(stages, steps_per_epoch):
        length = stage.steps if stage.steps is not None else max(1, round(stage.epochs * per_epoch))
        bounds.append((start, start + length))
        start += length
    return bounds
