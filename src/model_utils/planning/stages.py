"""The preflight's checks of a curriculum's stages against the model (config/stages.py reads them; train/stages.py
runs them): a stage naming what the model has not, or leaving it nothing to train, is refused before GPUs are
allocated. The names a stage may use: module prefixes of the model (built on the meta device: nothing allocated),
a vision-language model's parts (vision_tower, projector, language_model), a model of your own's groups.
"""

from __future__ import annotations

from model_utils.config.stages import read_stages
from model_utils.core.problems import Problem


def stage_problems(plan) -> list[Problem]:
    """Every stage's names checked against the plan's model (none where the model could not be planned)."""
    stages, _ = read_stages(plan.cfg.curriculum.stages)
    if not stages or plan.model is None:
        return []
    groups, modules = names_of(plan)
    return stage_names_problems(stages, groups, modules)


def group_matchers(model) -> dict:
    """The names a stage may use beyond module prefixes, each a test of a parameter's name: a vision-language model's
    parts, a model of your own's groups (its parameter_groups). The preflight checks names against them, the run
    groups the optimizer's parameters by them (train.stages.stage_groups)."""
    from model_utils.models.vision.parts import PARTS, part_of

    if model.vision is not None:
        return {part: (lambda name, part=part: part_of(name) == part) for part in PARTS}
    if model.custom is not None:
        return {group: (lambda name, prefixes=prefixes: any(name == p or name.startswith(p + ".") for p in prefixes))
                for group, prefixes in model.custom.groups.items()}
    return {}


def names_of(plan) -> tuple[dict, tuple[str, ...]]:
    """(the model's groups, group_matchers; every module's dotted name) of the plan's model."""
    model = plan.model
    if model.custom is not None:
        modules = model.custom.modules
    elif model.vision is not None:
        from model_utils.models.vision.build import meta_vision_model

        modules = tuple(name for name, _ in meta_vision_model(model.vision.config, ()).named_modules() if name)
    else:
        from model_utils.models.lora import meta_model

        modules = tuple(name for name, _ in meta_model(model.config, None).named_modules() if name)
    return group_matchers(model), modules


def stage_names_problems(stages, groups: dict, modules: tuple[str, ...]) -> list[Problem]:
    """A stage naming what the model has not, or freezing everything it has."""
    problems = []
    top = tuple(m for m in modules if "." not in m)
    whole = set(groups) or set(top)  # what freezing all of would leave nothing to train
    named = (f"one of its groups ({', '.join(groups)}) or " if groups else "") + \
        f"a module prefix such as {', '.join(top)[:200]}"
    for number, stage in enumerate(stages, start=1):
        names = stage.train if stage.train is not None else stage.freeze
        for name in names:
            if name not in groups and name not in modules:
                problems.append(Problem(f"stages[{number}] ({stage.name})", name, "names no group or module of the "
                                        "model", f"name {named}"))
        if stage.train is None and stage.freeze and whole and set(stage.freeze) >= whole:
            problems.append(Problem(f"stages[{number}] ({stage.name}).freeze", list(stage.freeze),
                                    "freezes every group of the model: nothing would train",
                                    "leave one group out of freeze, or name what trains with train:"))
    return problems
