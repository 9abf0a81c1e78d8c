"""The plan of a model of your own (`--model FILE.py:FUNCTION`, models/custom/contract.py) and of a dataset of your own
(`--dataset FILE.py:FUNCTION`, data/custom/dataset.py), beside the text and vision models' (plan.py, vision.py):

    load_custom_model   the run's tokenizer; the model built on the meta device: its parameters, groups and hooks
    custom_peak_bytes   one GPU's memory at a micro-batch: weights, gradients and optimizer states by the ZeRO stage
                        and offload, plus the activations the model's activation_bytes hook states (else not counted)
    custom_memory       its train step's bytes at the plan's micro-batch
    check_custom_plan   the preflight's lines and checks: memory, the data's first micro-batch
                        and, on the meta device, that the forward returns a loss
"""

from __future__ import annotations

from dataclasses import dataclass

from model_utils.config import deepspeed as dsc
from model_utils.config.settings import TrainConfig
from model_utils.config.stages import read_stages
from model_utils.core.problems import Problem
from model_utils.core.user_code import is_user_function
from model_utils.models.custom.contract import (BatchFlops, ModelSettings, UserModelError, build_user_model, hook,
                                                loss_of, parameter_counts, parameter_groups)
from model_utils.models.memory import GIB
from model_utils.planning.memory_model import ModelPlan

HOOKS = ("parameter_groups", "loss_tokens", "flops", "activation_bytes")


@dataclass(frozen=True)
class CustomPlan:
    """A model of your own as the plan sized it on the meta device."""

    spec: str  # --model FILE.py:FUNCTION
    settings: ModelSettings
    groups: dict  # parameter_groups(): group -> module prefixes
    modules: tuple[str, ...]  # every module's dotted name (what a stage may name)
    hooks: tuple[str, ...]  # the optional hooks the module defines
    activation_bytes: object = None  # its activation_bytes hook (bound to the meta module: sizes only), or None
    width: int = 0  # the commonest input width of its matrices: what ZeRO's "auto" bucket sizes scale with


    def describe(self) -> str:
        hooks = ", ".join(self.hooks) if self.hooks else "none (the defaults)"
        groups = ", ".join(f"{name} ({', '.join(prefixes)})" for name, prefixes in self.groups.items())
        return f"model of your own: {self.spec}; its groups: {groups}; hooks: {hooks}"


def model_settings(cfg: TrainConfig, tokenizer) -> ModelSettings:
    return ModelSettings(args=dict(cfg.model.model_args or {}), tokenizer=tokenizer, seq_len=cfg.model.seq_len,
                         seed=cfg.seed, gradient_checkpointing=cfg.model.gradient_checkpointing)


def data_settings(cfg: TrainConfig, tokenizer, stage=None):
    """The settings of the run's dataset function, for `stage` (config.stages.Stage) where there are stages: its
    data_args merged over --data_args (data.custom.dataset.DataSettings)."""
    from model_utils.data.custom.dataset import DataSettings  # numpy: imported where data are read

    args = dict(cfg.data.data_args or {})
    if stage is not None and stage.data_args:
        args.update(stage.data_args)
    return DataSettings(args=args, tokenizer=tokenizer, seq_len=cfg.model.seq_len, seed=cfg.seed,
                        stage=stage.name if stage is not None else None)


def load_custom_model(cfg: TrainConfig) -> tuple[object, ModelPlan | None, list[Problem]]:
    """(tokenizer, the model sized on the meta device, problems)."""
    from model_utils.data.tokenizer import load_tokenizer

    spec = cfg.model.model
    try:
        tokenizer = load_tokenizer(cfg.model.tokenizer)
    except (OSError, ValueError) as e:
        return None, None, [Problem("--tokenizer", cfg.model.tokenizer, f"could not be loaded: {e}".split("\n")[0],
                                    "pass a local tokenizer directory, or leave --tokenizer out for the shipped one")]
    settings = model_settings(cfg, tokenizer)
    try:
        sized = build_user_model(spec, settings, device="meta")
    except UserModelError as e:
        return tokenizer, None, [e.problem]
    total, trainable = parameter_counts(sized)
    groups = parameter_groups(sized)
    from model_utils.models.build import decay_groups

    plan = CustomPlan(spec, settings, groups, tuple(name for name, _ in sized.named_modules() if name),
                      tuple(name for name in HOOKS if hook(sized, name)), hook(sized, "activation_bytes"),
                      model_width(sized))
    model = ModelPlan(tokenizer, None, total,
                      param_groups=tuple(tuple(p.numel() for p in group)
                                         for group in decay_groups(p for p in sized.parameters() if p.requires_grad)),
                      checkpointable_layers=0, flops=BatchFlops(), frozen_params=total - trainable,
                      largest_param=max(p.numel() for p in sized.parameters()), custom=plan)
    return tokenizer, model, []


def model_width(model) -> int:
    """The commonest input width of the model's matrices (a transformer's hidden size), at least 1: ZeRO's "auto"
    bucket sizes (hidden size squared, as transformers' DeepSpeed integration sets them) follow it."""
    from collections import Counter

    widths = Counter(p.shape[-1] for p in model.parameters() if p.dim() == 2)
    return max(widths.most_common(1)[0][0], 1) if widths else 1


def custom_peak_bytes(model: ModelPlan, ds: dict, ranks: int, micro: int) -> float:
    """One GPU's peak bytes in the train step: 16-bit weights (ZeRO-3: a share,
    plus the largest parameter gathered), gradients (ZeRO-2/3: a share), fp32 master weights and Adam's two moments
    (a share under ZeRO; none where the optimizer is offloaded), and the activation_bytes hook's figure."""
    stage, (off_opt, off_par) = dsc.zero_stage(ds), dsc.offloads(ds)
    half = dsc.precision(ds) != "fp32"
    n, t = model.num_params, model.trainable_params
    weight = 2 if half else 4
    weights = 0 if off_par else (weight * n / ranks + 2 * weight * model.largest_param if stage == 3 else weight * n)
    grads = weight * t / (ranks if stage >= 2 else 1)
    states = 0 if off_opt else (12 if half else 8) * t / (ranks if stage >= 1 else 1)
    hook = model.custom.activation_bytes
    return weights + grads + states + (float(hook(micro)) if hook is not None else 0.0)


def custom_memory(plan) -> float:
    """One GPU's train-step bytes of a model of your own at the plan's micro-batch."""
    return custom_peak_bytes(plan.model, plan.ds_config, plan.ranks, plan.batch.micro)


def custom_problems(cfg: TrainConfig) -> list[Problem]:
    """What a model of your own does not take (before anything is built)."""
    problems = []
    spec = cfg.model.model
    for flag, given, why in (("--lora_rank", cfg.model.lora_rank, "LoRA adapts transformers models by their layer "
                              "names"), ("--generate_prompt", cfg.logging.generate_prompt, "the sample generates "
                              "through transformers"), ("--sequence_parallel", cfg.model.sequence_parallel > 1,
                              "Ulysses splits transformers' attention"),
                             ("--document_mask", cfg.data.document_mask, "the positions are your model's")):
        if given:
            problems.append(Problem(flag, given, f"is not for a model of your own ({spec}): {why}",
                                    f"leave {flag} out (build it into your model where you need it)"))
    return problems


def check_custom_plan(plan, report, check_data: bool) -> None:
    """The preflight's lines of a model of your own and its checks (report: planning.report.Report)."""
    cfg, model = plan.cfg, plan.model
    custom = model.custom
    report.lines.append(custom.describe())
    report.lines.append(f"model: {model.num_params / 1e6:,.2f}M parameters, {model.trainable_params / 1e6:,.2f}M "
                        f"trained, ZeRO stage {dsc.zero_stage(plan.ds_config)}")
    train = plan.memory.phases.train  # the plan's (custom_memory)
    counted = custom.activation_bytes is not None
    memory, where = plan.hardware.gpu_memory_gib, plan.hardware.gpu_memory_source
    activations = (", activations by your activation_bytes hook" if counted else
                   "; activations not counted: define activation_bytes(micro_batch) on your model to plan them")
    gpu = f"{memory:.0f} GiB ({where})" if memory else where
    report.estimate(f"memory: ~{train / GIB:.2f} GiB per GPU estimated in the train step (weights, gradients, "
                    f"optimizer states{activations}); GPU: {gpu}")
    if memory and train > memory * GIB:
        report.problems.append(Problem("--micro_batch_size", plan.batch.micro, f"~{train / GIB:.1f} GiB per GPU "
                                       f"estimated, more than the GPU's {memory:.0f} GiB",
                                       "use a smaller micro-batch, ZeRO-3 or an offload preset (configs/)"))
    stages, _ = read_stages(cfg.curriculum.stages)
    if check_data and is_user_function(cfg.data.dataset):
        check_forward(plan, report, stages)


def check_forward(plan, report, stages) -> None:
    """Each stage's data (or the run's) read and their first items collated; the forward run on the meta device on
    those items must return a scalar loss (a forward that cannot run on the meta device is left to the first step)."""
    import torch

    from model_utils.data.custom.dataset import load_user_data
    from model_utils.data.errors import DataError

    cfg = plan.cfg
    first = None
    for stage in stages or (None,):
        try:
            data = load_user_data(cfg.data.dataset, data_settings(cfg, plan.tokenizer, stage),
                                  cfg.data.validation_fraction)
        except DataError as e:
            report.problems.append(e.problem)
            return
        report.lines.append(f"data: {data.description}")
        first = first or data.train.batch([int(i) for i in data.train_ids[:plan.batch.micro]])
    module = build_user_model(cfg.model.model, model_settings(cfg, plan.tokenizer), device="meta")
    inputs = {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in first.inputs.items()}
    try:
        output = module(**inputs)
    except (RuntimeError, NotImplementedError, TypeError, ValueError) as e:
        if isinstance(e, TypeError) and "argument" in str(e):  # the batch's keys are not the forward's arguments
            report.problems.append(Problem("--dataset", cfg.data.dataset, f"a micro-batch's keys "
                                           f"({', '.join(sorted(inputs))}) do not fit the model's forward: {e}",
                                           "collate into the keyword arguments your model's forward takes"))
            return
        report.notes.append(f"your model's forward does not run on the meta device ({type(e).__name__}: "
                            f"{str(e)[:120]}): its loss is checked at the first step")
        return
    try:
        loss_of(output, cfg.model.model)
    except UserModelError as e:
        report.problems.append(e.problem)
