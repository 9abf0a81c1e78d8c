"""A curriculum's stages in a run (config/stages.py reads them from the run file): where each starts and ends, the
data each reads, what each trains, and the learning rate of every step.

- Steps: stage k runs the run's steps bounds[k] = [start, end); `epochs` become steps from the stage's data at the
  run's batch. The run's length is the last stage's end.
- Data: a stage with data of its own (its data_args, for a dataset of your own) starts them at epoch 0; a stage on
  the same data as the one before continues where it left off. A checkpoint holds the data position within the stage
  the step is in, so a resume lands inside the right stage at the exact item.
- What trains: every parameter the stages ever train is in the optimizer from the start (ZeRO partitions the
  optimizer's parameters once, at deepspeed.initialize), grouped by the stages that train it; a stage that does not
  train a group gives it learning rate 0, which leaves AdamW's update exactly zero (no step, no weight decay). Its
  gradients are still computed.
- The learning rate: `StageSchedule` replaces ds_config.json's scheduler: each stage warms up to its learning_rate
  over its warmup_steps, then holds it or decays it to 0 by its end (constant, linear, cosine); each group's rate is
  that times its part's factor (--vision_tower_lr, --projector_lr), or 0 where the stage freezes it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from model_utils.config.stages import Stage, stage_bounds
from model_utils.core.problems import ConfigError, Problem
from model_utils.data.blocks import BlockOrder, DataPosition


@dataclass
class Curriculum:
    """The stages of a run with their steps, data and orders (one per stage; stages on the same data share them)."""

    stages: tuple[Stage, ...]
    bounds: list[tuple[int, int]]
    data: list = field(default_factory=list)  # per stage: PackedData or data.custom.UserData
    orders: list = field(default_factory=list)  # per stage: BlockOrder
    groups: dict = field(default_factory=dict)  # names a stage may use beyond module prefixes: name -> matcher

    @property
    def total_steps(self) -> int:
        return self.bounds[-1][1]

    def index_at(self, step: int) -> int:
        """The stage that trains step `step` + 1 (the stage of a run that has done `step` steps)."""
        for k, (_, end) in enumerate(self.bounds):
            if step < end:
                return k
        return len(self.bounds) - 1

    def ends_at(self, step: int) -> bool:
        """Whether `step` is the last step of a stage that another follows."""
        return any(end == step for _, end in self.bounds[:-1])

    def fresh_data(self, k: int) -> bool:
        """Whether stage k reads data of its own (from their start) rather than continuing the stage before's."""
        return k == 0 or self.data[k] is not self.data[k - 1]

    def describe(self) -> list[str]:
        return [stage.describe(end - start) + f" (steps {start + 1}-{end})"
                for stage, (start, end) in zip(self.stages, self.bounds)]


def plan_curriculum(stages: tuple[Stage, ...], data: list, seed: int, world: int, micro: int,
                    accumulation: int) -> Curriculum:
    """The stages' bounds from their data (an epoch: the data's global micro-batches over the accumulation) and each
    stage's order."""
    orders, steps_per_epoch = [], []
    for k, stage_data in enumerate(data):
        if k and stage_data is data[k - 1]:
            orders.append(orders[-1])
        else:
            orders.append(BlockOrder(stage_data.train_ids, seed, world, micro))
        steps_per_epoch.append(max(1, orders[-1].global_batches_per_epoch // accumulation))
    return Curriculum(stages, stage_bounds(stages, steps_per_epoch), data, orders)


def enter_stage(run, k: int, fresh: bool) -> None:
    """Make stage k the run's: its data and order, its data from their start where `fresh`."""
    run.data, run.order = run.stages.data[k], run.stages.orders[k]
    if fresh:
        run.position = DataPosition()


# ----------------------------------------------------------------------------------------------------------------------
# What trains in each stage: the optimizer's groups split by the stages that train their parameters
# ----------------------------------------------------------------------------------------------------------------------
def matcher(names: tuple[str, ...], groups: dict):
    """A test of a parameter's name: does it belong to one of `names` (a group of `groups`: name -> a test of a
    parameter's name, or a module prefix)."""
    tests = []
    for name in names:
        if name in groups:
            tests.append(groups[name])
        else:
            tests.append(lambda parameter, prefix=name: parameter == prefix or parameter.startswith(prefix + "."))
    return lambda parameter: any(test(_unwrapped(parameter)) for test in tests)


def _unwrapped(name: str) -> str:
    """A parameter's name as the model itself names it (peft's wrapper adds base_model.model.)."""
    return name.removeprefix("base_model.model.")


def trains(stage: Stage, groups: dict):
    """A test of a parameter's name: does `stage` train it."""
    if stage.train is not None:
        return matcher(stage.train, groups)
    if stage.freeze:
        frozen = matcher(stage.freeze, groups)
        return lambda parameter: not frozen(parameter)
    return lambda parameter: True


def stage_groups(model, param_groups: list[dict], stages: tuple[Stage, ...], groups: dict) -> list[dict]:
    """`param_groups` split so that each holds parameters the same stages train, each with `stage_mask` (a bool per
    stage). A stage name that matches no trained parameter, and a stage that trains none, stop the run."""
    names = {id(p): name for name, p in model.named_parameters()}
    tests = [trains(stage, groups) for stage in stages]
    problems = []
    for number, stage in enumerate(stages, start=1):
        for name in stage.train or stage.freeze:
            test = matcher((name,), groups)
            if not any(test(n) for n, p in model.named_parameters() if p.requires_grad):
                problems.append(Problem(f"stages[{number}] ({stage.name})", name, "matches no trained parameter of "
                                        "the model", "name a module prefix (as model.named_modules() names them) or "
                                        f"a group ({', '.join(groups) or 'the model defines none'})"))
    split = []
    for group in param_groups:
        buckets: dict[tuple, list] = {}
        for parameter in group["params"]:
            mask = tuple(test(names[id(parameter)]) for test in tests)
            buckets.setdefault(mask, []).append(parameter)
        split += [dict(group, params=params, stage_mask=mask) for mask, params in buckets.items() if params]
    for number, stage in enumerate(stages):
        if not problems and not any(g["stage_mask"][number] for g in split):
            problems.append(Problem(f"stages[{number + 1}] ({stage.name})", stage.train or stage.freeze,
                                    "trains no parameter", "name what trains with train:, or freeze less"))
    if problems:
        raise ConfigError(problems)
    return split


# ----------------------------------------------------------------------------------------------------------------------
# The learning rate of every step
# ----------------------------------------------------------------------------------------------------------------------
def stage_rate(stage: Stage, peak: float, j: int, n: int) -> float:
    """Stage step j (0-based) of n: linear warm-up over warmup_steps to `peak`, then constant, linear or cosine to 0."""
    warmup = stage.warmup_steps
    if j < warmup:
        return peak * (j + 1) / (warmup + 1)
    if stage.decay == "constant":
        return peak
    progress = (j - warmup) / max(1, n - warmup)
    if stage.decay == "linear":
        return peak * (1 - progress)
    return peak * 0.5 * (1 + math.cos(math.pi * progress))


class StageSchedule:
    """The stages' learning rates as a scheduler DeepSpeed steps after each update (deepspeed.initialize's
    lr_scheduler: it saves and loads with the checkpoint). Iteration i is the run's step i + 1."""

    def __init__(self, optimizer, curriculum: Curriculum, base_lr: float):
        self.optimizer, self.curriculum, self.base_lr = optimizer, curriculum, base_lr
        self.last_batch_iteration = -1

    def rates(self, iteration: int) -> list[float]:
        k = self.curriculum.index_at(max(iteration, 0))
        stage, (start, end) = self.curriculum.stages[k], self.curriculum.bounds[k]
        peak = stage.learning_rate if stage.learning_rate is not None else self.base_lr
        rate = stage_rate(stage, peak, max(iteration, 0) - start, end - start) if iteration >= 0 else 0.0
        return [rate * group.get("lr_scale", 1.0) * (1.0 if group.get("stage_mask", (True,) * (k + 1))[k] else 0.0)
                for group in self.optimizer.param_groups]

    def step(self, iteration: int | None = None) -> None:
        self.last_batch_iteration = self.last_batch_iteration + 1 if iteration is None else iteration
        for group, rate in zip(self.optimizer.param_groups, self.rates(self.last_batch_iteration)):
            group["lr"] = rate

    def get_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    get_last_lr = get_lr

    def state_dict(self) -> dict:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state: dict) -> None:
        self.step(state["last_batch_iteration"])
