"""Preflight: check everything a run needs in seconds, on a login node, before GPUs are allocated.

`python src/train_deepspeed.py ... --preflight` prints the effective configuration and the plan, then every problem at
once (setting, bad value, fix) and exits 0 or 2. `checked_plan` runs the same checks at the start of every real run,
before the trainer builds it.
Nothing here builds the model or tokenizes the whole dataset: the model is sized from its config on the meta device,
the data is checked on a sample (or read from the packed cache when it exists).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import json
import os
import shutil
import socket
from dataclasses import dataclass, field

from .config import ConfigError, Problem, TrainConfig, validate_args
from .ds_config import suggest
from .memory import GIB, activation_bytes, cheapest_fit
from .plan import Plan, make_plan, partial_offload_that_fits

SAMPLE_DOCUMENTS = 200
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


@dataclass
class Report:
    """What the preflight says about a plan: the lines it prints, notes, problems, and the memory and disk estimates
    (which a starting run also logs)."""

    plan: Plan | None = None
    lines: list[str] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    estimates: list[str] = field(default_factory=list)

    def estimate(self, line: str) -> None:
        self.lines.append(line)
        self.estimates.append(line)


def planned_world_size() -> int:
    """What the run will have: the launchers export WORLD_SIZE (nodes x GPUs per node) for the preflight."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def run_preflight(cfg: TrainConfig, world_size: int | None = None, check_data: bool = True) -> Report:
    """`--preflight`: plan the run as its start would, on this machine, then check and print the plan."""
    missing = [name for name in ("torch", "deepspeed", "transformers") if importlib.util.find_spec(name) is None]
    if missing:
        return config_only_preflight(cfg, world_size or planned_world_size(), missing)
    from .build_locks import stale_build_lock_problems

    report = check_plan(make_plan(cfg, world_size or planned_world_size()), check_data)
    report.problems += stale_build_lock_problems()  # a run would hang at its start (a login node shares the home)
    return report


def checked_plan(cfg: TrainConfig, dist, log) -> Plan:
    """A run's own plan, checked on every rank before anything expensive. Rank 0 decides what all ranks share (the
    resume point, the data source): a save or a retention delete in between must not split them. Every rank plans
    and checks its own node, and all stop together on any rank's problem (ConfigError), which rank 0 reports. The
    data are checked while the run tokenizes them."""
    plan = make_plan(cfg, dist.world_size, on_training_hardware=True, decides=dist.is_main,
                     move_incomplete=dist.is_main)
    report = check_plan(plan, check_data=False)
    report.problems = merge_rank_problems(dist.all_gather_object((socket.gethostname(), report.problems)))
    raise_on_problems(report)
    for note in report.notes:
        log.warn(note)
    for line in report.estimates:  # memory and checkpoint disk; the run logs its config, batch and model lines
        log.info(line)
    resume, source, data_format = dist.broadcast_object((plan.resume, plan.data_source, plan.data_format))
    return dataclasses.replace(plan, resume=resume, data_source=source, data_format=data_format)


def check_plan(plan: Plan, check_data: bool = True, check_disk: bool = True) -> Report:
    """Every check of a plan, and the lines that describe it. Nothing here is built or resolved: the run builds from the
    same plan. `check_data` False leaves the data to the run (which checks it while tokenizing); `check_disk` False is
    for a caller that never saves (the benchmark), whose checkpoint directory needs no room."""
    import torch

    from .speed import fused_kernels_problem
    from .models import check_vocab_covers_tokenizer, masks_documents_by_position

    cfg, mconf, seq_len = plan.cfg, plan.model.config if plan.model else None, plan.seq_len
    report = Report(plan, problems=list(plan.problems), notes=list(plan.notes))
    if mconf is not None:
        p = check_vocab_covers_tokenizer(mconf, plan.tokenizer, cfg.model.model, cfg.model.tokenizer)
        if p:
            report.problems.append(p)
        max_pos = getattr(mconf, "max_position_embeddings", None)
        if max_pos and seq_len > max_pos:
            report.problems.append(Problem("--seq_len", seq_len, f"exceeds the model's max_position_embeddings ({max_pos})",
                                           f"use --seq_len {max_pos} or less"))
        if cfg.data.document_mask and not masks_documents_by_position(mconf):
            report.problems.append(Problem("--document_mask", True, f"this model ({type(mconf).__name__}) does not build "
                                           "its attention mask with transformers' create_causal_mask, which turns "
                                           "restarting positions into a mask per document",
                                           "leave out --document_mask (documents are then separated by EOS only)"))
        if cfg.data.document_mask and plan.tokenizer.eos_token_id is None:
            report.problems.append(Problem("--document_mask", True, "the tokenizer has no EOS token to end documents",
                                           "use a tokenizer with an eos_token, or leave out --document_mask"))
    p = fused_kernels_problem(cfg.speed, torch.cuda.is_available())
    if p:
        report.problems.append(p)
    if plan.raw_ds_config is not None:
        report.problems += check_known_keys(plan.raw_ds_config)

    ds, batch = plan.ds_config, plan.batch
    if ds is not None:
        report.lines.append("effective DeepSpeed config:\n" + json.dumps(ds, indent=2))
        report.lines.append(f"batch: {batch.describe()}")
        if plan.micro_batch_choice:
            report.lines.append(f"micro-batch: {plan.micro_batch_choice}")
        if plan.memory and plan.memory.checkpointed_layers_choice:
            report.lines.append(f"checkpointed layers: {plan.memory.checkpointed_layers} of "
                                f"{plan.model.config.num_hidden_layers} recompute ({plan.memory.checkpointed_layers_choice})")
        if plan.memory and plan.memory.delayed_prefetch_choice:
            report.lines.append(f"delayed update prefetch: {plan.memory.delayed_prefetch_choice}")
        report.lines.append(f"plan: {batch.plan(cfg.batch.max_steps, streamed=cfg.data.streaming)}"
                            if cfg.batch.num_epochs is None else
                            f"plan: {cfg.batch.num_epochs:g} epochs (steps from the packed data)")
        if plan.fine_tuning is not None:
            report.lines.append(plan.fine_tuning.describe())
    if plan.memory is not None:
        _check_memory(plan, report)
        _note_offload_accumulation(plan, report)
        _note_parameter_fetches(plan, report)
        _note_parameters_fit_on_the_gpu(plan, report)
        _note_faster_zero3_setup(plan, report)
        _estimate_offload_update(plan, report)
        _check_host_memory(plan, report)
        if check_disk:
            _check_checkpoint_dir(cfg, plan.checkpoints.bytes, report)
        report.estimate(f"checkpoint writes: {plan.checkpoints.description}")
    if ds is not None and check_data:
        _check_data(plan, report)
    _check_resume(plan, report)
    return report


def _check_host_memory(plan: Plan, report: Report) -> None:
    """Offloaded states live in the node's memory: a node without room for them would be killed minutes into setup."""
    if not plan.memory.host_bytes:
        return
    need, available = plan.memory.host_bytes / GIB, plan.hardware.host_available
    loading = plan.memory.host_bytes + plan.memory.resume_host_bytes
    report.estimate(f"host memory: ~{need:.0f} GiB per node for the offloaded states of {plan.hardware.ranks_per_node} rank(s)"
                    + (f", ~{loading / GIB:.0f} GiB while a resume loads a checkpoint" if plan.memory.resume_host_bytes else "")
                    + (f"; {available / GIB:.0f} GiB available" if available is not None else
                       " (the GPU nodes' memory is checked when the run starts there)"))
    if available is not None and plan.memory.host_bytes <= available < loading:
        if plan.resume is not None:  # the kernel would kill the ranks while they load, with no message of ours
            cfg = plan.cfg
            setting, value = (("--resume_from_checkpoint", cfg.checkpoint.resume_from_checkpoint) if cfg.checkpoint.resume_from_checkpoint
                              else ("--resume", cfg.checkpoint.resume))
            report.problems.append(Problem(
                setting, value,
                f"loading {plan.resume.path.name} needs ~{loading / GIB:.0f} GiB of host memory on this node beside "
                f"the offloaded states, {available / GIB:.0f} GiB are available",
                "resume on nodes with more memory, or on more of them (the states divide among the ranks); the "
                "checkpoint is intact"))
        else:
            report.notes.append(
                f"this node holds the offloaded states (~{need:.0f} GiB of {available / GIB:.0f}) but not a resume "
                f"of their checkpoint (~{loading / GIB:.0f} GiB while it loads): resume on nodes with more memory")
    if available is not None and plan.memory.host_bytes > available:
        partial = partial_offload_that_fits(plan, available)
        report.problems.append(Problem(
            "zero_optimization.offload_optimizer / offload_param", f"{plan.model.num_params / 1e9:.1f}B parameters",
            f"the offloaded states need ~{need:.0f} GiB of host memory on this node, {available / GIB:.0f} GiB are "
            "available",
            ("keep part of the optimizer on the GPU: configs/zero3-offload.json with "
             + ("\"offload_param\": {\"device\": \"none\"} and " if partial[1] == "none" else "")
             + f"\"offload_optimizer\": {{\"ratio\": {partial[0]:g}}} (~{partial[2] / GIB:.0f} GiB host, "
             f"~{partial[3] / GIB:.0f} GiB GPU at micro-batch 1 by the estimate; not measured on GPUs), or "
             if partial else "")
            + "use more GPUs or nodes (ZeRO divides the offloaded states among the ranks), a node with more memory, "
            "or ZeRO-3 without offload on enough GPUs to hold the model states"))


def _note_offload_accumulation(plan: Plan, report: Report) -> None:
    """ZeRO-1/2 with the optimizer offloaded and gradient accumulation: unless gradients accumulate in DeepSpeed's fp32
    buffer on the GPU, each micro-batch's gradients go to the CPU and back (the seeds' configs do this)."""
    from . import ds_config as dsc
    from .memory import AUTO_MEMORY_SHARE

    ds = plan.ds_config
    if not (dsc.zero12_optimizer_offload(ds) and dsc.precision(ds) != "fp32"
            and plan.batch.accumulation > 1 and not dsc.fp32_grad_accumulation(ds)):
        return
    extra = 4 * plan.model.num_params / plan.world
    budget = AUTO_MEMORY_SHARE * plan.hardware.gpu_memory_gib * GIB if plan.hardware.gpu_memory_gib else None
    room = ("" if budget is None else ", which fits beside this run" if plan.memory.phases.peak[1] + extra <= budget
            else ", more than this micro-batch leaves (with \"auto\" the micro-batch makes room)")
    report.notes.append(
        f"with the optimizer offloaded, DeepSpeed sends each of the {plan.batch.accumulation} micro-batches' gradients "
        "to the CPU and back: \"data_types\": {\"grad_accum_dtype\": \"fp32\"} accumulates them on the GPU and copies "
        "them once per step (configs/zero2-offload.json has it; docs/PERFORMANCE.md gives the gain), for "
        f"~{extra / GIB:.1f} GiB more per GPU{room}")


def _note_parameter_fetches(plan: Plan, report: Report) -> None:
    """ZeRO-3 with the parameters offloaded fetches all of them from host memory for every micro-batch's forward and
    again for its backward, so a step's micro-batches multiply that traffic: a given micro-batch smaller than the
    largest that fits, or a run without activation checkpointing, under which a larger one would fit."""
    from . import ds_config as dsc
    from .plan import automatic_micro_batch, checkpointed_micro_that_fits

    ds, batch = plan.ds_config, plan.batch
    if not (dsc.zero_stage(ds) == 3 and dsc.offloads(ds)[1] and batch.accumulation > 1):
        return
    per_rank = batch.micro * batch.accumulation
    best = None if plan.micro_batch_choice else automatic_micro_batch(plan)  # "auto" already took the largest
    if best is not None and best > batch.micro:
        fetched = 2 * 2 * plan.model.num_params / plan.world  # 16-bit parameters, forward and backward
        report.notes.append(
            f"ZeRO-3 with the parameters offloaded fetches all of them from host memory for each micro-batch's forward "
            f"and backward (~{fetched / GIB:.0f} GiB per rank), {batch.accumulation} times per step at micro-batch "
            f"{batch.micro}: micro-batch {best} (x {per_rank // best}) fits by the estimate and fetches them "
            f"{per_rank // best} times (--micro_batch_size auto; docs/PERFORMANCE.md measures the difference)")
    checkpointed = checkpointed_micro_that_fits(plan)
    if checkpointed is not None:
        micro, gpu = checkpointed
        report.notes.append(
            f"with --gradient_checkpointing, micro-batch {micro} (x {per_rank // micro}) fits by the estimate "
            f"(~{gpu / GIB:.1f} GiB) and fetches the offloaded parameters {per_rank // micro} times per step instead of "
            f"{batch.accumulation}, for a third more forward compute, less with --checkpointed_layers auto, which "
            "recomputes only the layers the GPU needs (docs/PERFORMANCE.md measures both)")


def _note_parameters_fit_on_the_gpu(plan: Plan, report: Report) -> None:
    """ZeRO-3 with the parameters offloaded where they fit on the GPUs beside ZeRO-2's states: ZeRO-2 with only the
    optimizer offloaded fetches nothing from host memory."""
    from . import ds_config as dsc
    from .plan import zero2_offload_that_fits

    ds = plan.ds_config
    if not (dsc.zero_stage(ds) == 3 and dsc.offloads(ds)[1]):
        return
    fits = zero2_offload_that_fits(plan)
    if fits is None:
        return
    micro, gpu = fits
    report.notes.append(
        f"the parameters ZeRO-3 offloads here, and fetches for every micro-batch, fit on the GPU: "
        f"configs/zero2-offload.json (ZeRO-2, the optimizer offloaded, gradients accumulated in fp32 on the "
        f"GPU) fits at micro-batch {micro} by the estimate (~{gpu / GIB:.1f} GiB) and fetches nothing, the faster of "
        "the two where both fit (docs/PERFORMANCE.md)")


def _note_faster_zero3_setup(plan: Plan, report: Report) -> None:
    """ZeRO-3 without offload where a faster setup fits the GPUs at the same micro-batch. With partitioned parameters
    ZeRO-3 gathers every layer's parameters for its forward and again for its backward: names "auto" persistence
    where whole parameters fit under ZeRO-3, else ZeRO-2 where that fits. With whole parameters already, ZeRO-2 where
    it fits: the same data cross the GPUs, without ZeRO-3's hooks on every module. Advice only: the config stays the
    user's."""
    from . import ds_config as dsc
    from .plan import whole_parameters_that_fit, zero2_that_fits

    if plan.memory_model is None or plan.ds_config is None:
        return
    if plan.memory_model.keeps_whole_parameters(plan.ds_config):
        why = ("ZeRO-3 with whole parameters moves the same weights and gradients per step and adds DeepSpeed's hooks "
               "on every module, which cost most where the layers are small")
    else:
        traffic = ""
        if plan.world > 1:
            value_bytes = 4 if dsc.precision(plan.ds_config) == "fp32" else 2
            sizes = (plan.model.num_params, plan.model.trainable_params, plan.world, plan.batch.accumulation,
                     value_bytes)
            traffic = (f"; each GPU would receive ~{zero_traffic_per_step(*sizes, stage=2) / GIB:.1f} GiB of weights "
                       f"and gradients per step instead of ~{zero_traffic_per_step(*sizes, stage=3) / GIB:.1f}")
        whole = whole_parameters_that_fit(plan)
        if whole is not None:
            threshold = plan.ds_config["zero_optimization"].get("stage3_param_persistence_threshold")
            report.notes.append(
                f"whole parameters fit these GPUs at micro-batch {plan.batch.micro} by the estimate "
                f"(~{whole / GIB:.1f} GiB): ZeRO-3 would keep each on every GPU and run the same micro-batches "
                f"without gathering each layer's parameters for its forward and backward{traffic}: "
                f"\"stage3_param_persistence_threshold\": \"auto\" (now {threshold}) in zero_optimization where the "
                "run's speed matters (docs/PERFORMANCE.md, ZeRO-3 on several GPUs)")
            return
        why = ("it keeps whole parameters on every GPU and runs the same micro-batches without gathering each layer's "
               f"parameters for its forward and backward, as ZeRO-3 does{traffic}")
    gpu = zero2_that_fits(plan)
    if gpu is not None:
        report.notes.append(
            f"ZeRO-2 fits these GPUs at micro-batch {plan.batch.micro} by the estimate (~{gpu / GIB:.1f} GiB): {why}: "
            "\"stage\": 2 in the DeepSpeed config (ds_config.json has it) where the run's speed matters "
            "(docs/PERFORMANCE.md, ZeRO-3 on several GPUs)")


def zero_traffic_per_step(params: int, trainable: int, world: int, accumulation: int, value_bytes: int,
                          stage: int) -> float:
    """Bytes one GPU receives per optimizer step through ZeRO's collectives (ring all-gather and reduce-scatter bring
    (world - 1) / world of the whole tensor): ZeRO-3 gathers every parameter for each micro-batch's forward and again
    for its backward and reduce-scatters the trainable ones' gradients; ZeRO-1/2, and ZeRO-3 with whole parameters,
    reduce-scatter each micro-batch's gradients and gather the updated parameters once per step (Rajbhandari et al.
    2020: 3 against 2 model sizes per step at one micro-batch). `value_bytes`: 2 for 16-bit weights and gradients, 4
    for fp32."""
    share = (world - 1) / world
    if stage == 3:
        return accumulation * (2 * params + trainable) * value_bytes * share
    return (accumulation + 1) * trainable * value_bytes * share


# Host seconds of each part of an offload update per 10^9 parameters of a rank's offloaded partition on a 16-core host
# (benchmarks/offload_step.py measures them; docs/PERFORMANCE.md, Where an offload step goes). Under ZeRO-3 the
# delayed update leaves the conversion at the step's boundary, since the forward fetches the weights from the 16-bit
# partitions it writes.
OFFLOAD_UPDATE_PARTS_S_PER_BILLION = {"clip": 0.058, "DeepSpeedCPUAdam": 0.205, "bf16 conversion": 0.072,
                                      "copy to the GPU": 0.036}
OFFLOAD_UPDATE_S_PER_BILLION = sum(OFFLOAD_UPDATE_PARTS_S_PER_BILLION.values())


def _estimate_offload_update(plan: Plan, report: Report) -> None:
    """ZeRO with the optimizer offloaded: how long the GPU waits for each step's update on the host, and the flag
    that runs it beside the next step instead."""
    from . import ds_config as dsc

    ds = plan.ds_config
    if not (dsc.cpu_optimizer_offload(ds) and plan.model.num_params):
        return
    from_step = plan.cfg.optim.delayed_update_from_step
    ratio = dsc.partial_offload_ratio(ds)
    offloaded = plan.model.num_params / plan.world * (1.0 if ratio is None else ratio)
    seconds = OFFLOAD_UPDATE_S_PER_BILLION * offloaded / 1e9
    zero3 = dsc.zero_stage(ds) == 3
    if not from_step:
        overlap = ("the GPU waits for it: --delayed_update_from_step S runs it beside the next step, whose gradients "
                   "are then taken one update late (docs/PERFORMANCE.md)")
    elif plan.batch.accumulation > 1:
        overlap = f"from step {from_step} on it runs beside the next step (--delayed_update_from_step)"
    else:  # the boundary backward copies the gradients into the buffers the update reads, so it waits for it
        overlap = (f"from step {from_step} on it runs beside the next step's forward only: with one micro-batch per "
                   "step its backward waits for the update; gradient accumulation (a smaller micro-batch for the same "
                   "--global_batch_tokens) lets the update run beside the other micro-batches")
    if from_step and zero3:
        overlap += (f", all but the conversion to 16 bits "
                    f"(~{OFFLOAD_UPDATE_PARTS_S_PER_BILLION['bf16 conversion'] * offloaded / 1e9:.1f} s), "
                    "which ZeRO-3 keeps at the step's boundary")
    share = "" if ratio is None else f" (the offloaded {ratio:g} of them)"
    report.estimate(f"offload update: ~{seconds:.1f} s per step on the host for each rank's "
                    f"{offloaded / 1e9:.2f}B parameters{share} (at a 16-core host's rate); {overlap}")
    if os.environ.get("OMP_NUM_THREADS") == "1":
        report.notes.append(
            "OMP_NUM_THREADS=1 (torchrun's default with several processes per node) runs the CPU optimizer update on "
            "one core per rank, not the estimate's 16: unset it (each rank then takes its share of "
            "the node's cores) or set it to the node's cores divided by its ranks")


def _check_memory(plan: Plan, report: Report) -> None:
    """The model, its size and FLOPs; each phase's memory against the GPU's, with the cheapest fix when it does not fit."""
    from . import ds_config as dsc
    from .speed import liger_available, use_compile

    cfg, ds, mconf, micro = plan.cfg, plan.ds_config, plan.model.config, plan.batch.micro
    stage, (off_opt, off_par) = dsc.zero_stage(ds), dsc.offloads(ds)
    bf16 = dsc.precision(ds) != "fp32"
    report.lines.append(f"model: {cfg.model.model}, {plan.model.num_params / 1e6:,.1f}M parameters, "
                        f"{plan.model.flops.per_token() / 1e9:.2f} GFLOP/token, ZeRO stage {stage}"
                        f"{', optimizer offload' if off_opt else ''}{', parameter offload' if off_par else ''}")
    phases = plan.memory.phases
    peak_phase, total = phases.peak
    memory, where = plan.hardware.gpu_memory_gib, plan.hardware.gpu_memory_source
    report.estimate(f"memory: ~{total / GIB:.1f} GiB per GPU estimated, at its peak in {peak_phase} (train "
                    f"step {phases.train / GIB:.1f}: model states, ZeRO buckets, activations; evaluation "
                    f"{phases.evaluation / GIB:.1f}; export {phases.export / GIB:.1f}"
                    + (f"; generation {phases.generation / GIB:.1f}" if phases.generation else "")
                    + f"); GPU: {f'{memory:.0f} GiB' if memory else where}")
    if plan.parameters_choice:
        report.estimate(f"parameters: {plan.parameters_choice}")
    chunk = cfg.speed.flce_chunk_budget
    if plan.fused_loss and not plan.hardware.on_training_hardware and not liger_available():
        logits = activation_bytes(mconf, plan.seq_len, micro, False, False, bf16, chunk) - activation_bytes(
            mconf, plan.seq_len, micro, False, True, bf16, chunk)
        report.estimate(f"memory: assumes Liger's fused cross-entropy on the GPU nodes (not installed "
                        f"here); without it the logits add ~{logits / GIB:.0f} GiB")
    if memory and 0.92 * memory * GIB < total <= memory * GIB:
        report.notes.append(f"the memory estimate is within 8% of the GPU's {memory:.0f} GiB: expect little headroom")
    if memory and total > memory * GIB and peak_phase == "generation":
        report.problems.append(Problem(
            "--generate_prompt", cfg.logging.generate_prompt, f"loading the exported model for the sample needs "
            f"~{total / GIB:.0f} GiB per GPU beside the engine, more than the {memory:.0f} GiB available",
            "drop --generate_prompt and run `python -m model_utils.generate --model EXPORT_DIR` after the run"))
    elif memory and total > memory * GIB:
        report.problems.append(Problem(
            "train_micro_batch_size_per_gpu / zero_optimization", f"micro {micro}, ZeRO {stage}",
            f"needs ~{total / GIB:.0f} GiB per GPU, more than the {memory:.0f} GiB available",
            cheapest_fit(plan.model.trainable_params, mconf, plan.world, plan.seq_len, micro, bf16, plan.fused_loss,
                         chunk, memory, ds.get("zero_optimization", {}),
                         use_compile(plan.hardware.gpus, False, plan.cfg.speed), plan.hardware.host_available,
                         plan.hardware.ranks_per_node, adapters=plan.model.adapters,
                         frozen_params=plan.model.frozen_params)))


def config_only_preflight(cfg: TrainConfig, world: int, missing: list[str]) -> Report:
    """The checks a machine without torch/DeepSpeed can make (a login node): the arguments, the DeepSpeed config's
    JSON, its "auto" values and batch arithmetic; the report says what was left unchecked."""
    from . import ds_config as dsc

    report = Report()
    report.problems += validate_args(cfg)
    ds_path = cfg.optim.ds_config_path
    raw, problems = dsc.load_json(ds_path) if ds_path.is_file() else (None, [])
    report.problems += problems
    if raw is not None:
        ds, notes, problems = dsc.resolve(raw, cfg, world, "bf16", None, check_classes=False, seq_len=cfg.model.seq_len)
        report.notes += notes
        report.problems += problems
        if not any(p.setting.startswith(dsc.BATCH_SETTINGS) for p in problems):
            batch = dsc.Batch.of(ds, world, cfg.model.seq_len or 0)  # the block length needs the model: not known here
            report.lines.append("effective DeepSpeed config:\n" + json.dumps(ds, indent=2))
            report.lines.append(f"batch: micro {batch.micro} x grad_acc {batch.accumulation} x world {world} = "
                                f"{batch.blocks_per_step} blocks per step; {cfg.batch.max_steps} steps")
    report.notes.append(f"{', '.join(missing)} not installed here: checked the arguments and the DeepSpeed config's "
                        "JSON, batch and schedule; not checked: DeepSpeed key names, optimizer and scheduler "
                        "parameters, tokenizer, model, memory, data and checkpoints (pip install -e . here checks "
                        "them too; the run's own start checks them on the GPU nodes)")
    return report


def _check_checkpoint_dir(cfg: TrainConfig, ckpt_bytes: float, report: Report):
    path = cfg.checkpoint.run_dir.root
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        report.problems.append(Problem("--checkpoint_dir", cfg.checkpoint.checkpoint_dir, f"{probe} is a file, not a directory",
                                       "choose a directory path (on a filesystem all nodes share)"))
        return
    if not os.access(probe, os.W_OK):
        report.problems.append(Problem("--checkpoint_dir", cfg.checkpoint.checkpoint_dir, f"{probe} is not writable",
                                       "choose a directory you can write to (on a filesystem all nodes share)"))
        return
    # Periodic saves (by steps or by the clock) keep K complete checkpoints plus the one being written; without them
    # the run saves only at the end (or on a stop signal): one checkpoint. Keeping all (K = 0) by the clock alone:
    # at least two.
    periodic = bool(cfg.checkpoint.checkpoint_freq or cfg.checkpoint.checkpoint_minutes)
    if periodic:
        keep = cfg.checkpoint.keep_last_checkpoints or (max(1, cfg.batch.max_steps // cfg.checkpoint.checkpoint_freq) if cfg.checkpoint.checkpoint_freq else 1)
    else:
        keep = 0
    count = keep + 1
    # The complete checkpoints already there (a resumed run's) are among those and already take their disk: what
    # must be free is the rest, and at least the one being written before retention removes the oldest.
    from .checkpoint import list_checkpoints

    there = sum(c.complete for c in list_checkpoints(path))
    new = max(1, count - there)
    need = ckpt_bytes * new
    free = shutil.disk_usage(probe).free
    report.estimate(f"checkpoints: ~{ckpt_bytes / GIB:.2f} GiB each, {count} on disk at most"
                    + (f" ({there} there already)" if there else "") + f"; {free / GIB:,.0f} GiB free in {probe}")
    if need > free:
        shortfall = f"{new} more checkpoint(s) need ~{need / GIB:.0f} GiB, {free / GIB:.0f} GiB are free"
        if periodic:
            report.problems.append(Problem("--keep_last_checkpoints", cfg.checkpoint.keep_last_checkpoints, shortfall,
                                           "free space, keep fewer checkpoints, or use another --checkpoint_dir"))
        else:  # the last step's checkpoint alone does not fit: keeping fewer would not help
            report.problems.append(Problem("--checkpoint_dir", cfg.checkpoint.checkpoint_dir, shortfall,
                                           "free space there or use another --checkpoint_dir"))


def _check_data(plan: Plan, report: Report):
    """The column and tokenization of the plan's data source, on a sample; exact counts from the cache if built."""
    from .concat_dataset import (DUMMY_VALIDATION_FRACTION, OPENED_WITHOUT_TOKENIZING, DataError, block_count,
                                 cache_dir_for, describe_without_tokenizing, held_out_count, tokenize_split)
    from .sft_data import FORMATS

    cfg, tokenizer, seq_len, world, micro = plan.cfg, plan.tokenizer, plan.seq_len, plan.world, plan.batch.micro
    source = plan.data_source
    if cfg.data.dummy_data:
        report.lines.append(f"data: dummy, {cfg.data.dummy_data} random blocks")
        blocks = cfg.data.dummy_data - held_out_count(cfg.data.dummy_data, DUMMY_VALIDATION_FRACTION)
    elif source is None:  # not resolved: the plan's problems say why
        return
    elif source.kind == "stream":  # a sample of its first documents; its size is known only once read
        from .streaming import describe_stream

        try:
            report.lines.append(describe_stream(cfg.data, source, tokenizer))
        except DataError as e:
            report.problems.append(e.problem)
        return
    elif plan.data_format in FORMATS:  # fine-tuning examples
        try:
            line, blocks = describe_fine_tuning_data(plan)
        except DataError as e:
            report.problems.append(e.problem)
            return
        report.lines.append(line)
    elif source.kind in OPENED_WITHOUT_TOKENIZING:  # prepared shards, token files, a mixture
        try:
            line, blocks = describe_without_tokenizing(cfg.data, source, tokenizer, seq_len)
        except DataError as e:
            report.problems.append(e.problem)
            return
        report.lines.append(line)
    else:
        try:
            cache = cache_dir_for(cfg.data, source, tokenizer)
            if (cache / "meta.json").exists():
                meta = json.loads((cache / "meta.json").read_text())
                tokens = meta["tokens"]["train"]
                report.lines.append(f"data: {source.location}: {tokens:,} tokens (packed cache {cache})")
                blocks = block_count(tokens, seq_len)
                if "validation" not in meta["tokens"]:
                    blocks -= held_out_count(blocks, cfg.data.validation_fraction)
            else:
                sample, total_docs = _sample(source, cfg)
                tokenized = tokenize_split(sample, tokenizer, cfg.data.text_column, 1, "train (sample)")
                sample_tokens = sum(len(x) for x in tokenized["input_ids"])
                if sample_tokens == 0:
                    raise DataError(Problem("--text_column", cfg.data.text_column, "the sampled documents hold no text",
                                            "check the column's contents"))
                est = sample_tokens * (total_docs / len(sample)) if total_docs else None
                report.lines.append(f"data: {source.location}: column '{cfg.data.text_column}' present; "
                                    f"~{est:,.0f} tokens estimated from {len(sample)} documents" if est else
                                    f"data: {source.location}: column '{cfg.data.text_column}' present (streamed sample)")
                blocks = int(est // seq_len) if est else None
        except DataError as e:
            report.problems.append(e.problem)
            return
    if blocks is not None and cfg.batch.num_epochs is not None and blocks >= world * micro:
        from .fine_tuning import steps_for_epochs

        steps = steps_for_epochs(cfg.batch.num_epochs, blocks, world, micro, plan.batch.accumulation)
        report.lines.append(f"epochs: {cfg.batch.num_epochs:g} = ~{steps:,} steps at this batch (settled from the "
                            "packed data when the run starts)")
    if blocks is not None and blocks < world * micro:
        report.problems.append(Problem("--seq_len", seq_len, f"the data gives ~{blocks} training blocks, fewer than one "
                                       f"micro-batch per rank ({micro} x {world} ranks)",
                                       "use more data, a smaller --seq_len or a smaller micro-batch"))


SAMPLE_CHECKED_ROWS = 5000  # rows whose format is checked (cheap: no tokenization)


def describe_fine_tuning_data(plan: Plan) -> tuple[str, int | None]:
    """The data line and training blocks of fine-tuning data: from its packed cache where the run built it, else
    from the first rows: the format checked on SAMPLE_CHECKED_ROWS of each split (a mixed or wrong row is a DataError
    naming the file, the row and its columns) and SAMPLE_DOCUMENTS of them encoded and packed for the estimate."""
    from .concat_dataset import held_out_count
    from .sft_data import (ExampleEncoder, SFTSettings, check_rows, encode_rows, load_sft_splits, open_sft,
                           pack_examples, sft_cache_dir, source_key, _cache_root)

    cfg, source, tokenizer = plan.cfg.data, plan.data_source, plan.tokenizer
    settings = SFTSettings(plan.seq_len, plan.data_format, cfg.train_on_prompts, cfg.validation_fraction)
    cache = sft_cache_dir(_cache_root(cfg), source_key(source, cfg), tokenizer, settings)
    if (cache / "meta.json").exists():
        data = open_sft(cache, cfg.validation_fraction)
        return f"data: {data.description} (packed cache {cache})", len(data.train_ids)
    train, validation = load_sft_splits(source, cfg)
    for split, rows in (("train", train), ("validation", validation)):
        if rows is not None:
            check_rows(rows.select(range(min(SAMPLE_CHECKED_ROWS, len(rows)))), plan.data_format,
                       f"{source.location} ({split} split)")
    sample = train.select(range(min(SAMPLE_DOCUMENTS, len(train))))
    encoder = ExampleEncoder(tokenizer, plan.data_format, cfg.train_on_prompts, source.location)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    stats = pack_examples(encode_rows(sample, encoder, checked=True), plan.seq_len, pad, len(tokenizer)).stats
    blocks = int(stats.blocks * len(train) / max(len(sample), 1))
    if validation is None:
        blocks -= held_out_count(blocks, cfg.validation_fraction)
    return (f"data: {source.location}: fine-tuning data ({encoder.describe()}), {len(train):,} rows; the first "
            f"{len(sample)}: {stats.describe()}; ~{blocks:,} training blocks estimated"), blocks


def _sample(source, cfg):
    import datasets

    from .concat_dataset import LOAD_ERRORS, DataError, load_problem, load_splits, stream_documents

    if source.kind == "hub":
        try:
            wanted = min(SAMPLE_DOCUMENTS, cfg.data.max_documents or SAMPLE_DOCUMENTS)
            rows = list(stream_documents(source.location, cfg.data.dataset_config_name, None, "train", wanted))
        except LOAD_ERRORS as e:
            raise load_problem(source, e) from e
        if not rows:
            raise DataError(Problem("--dataset", source.location, "is empty", "point --dataset at data with documents"))
        # The document count is known when the sample holds them all, or when --max_documents caps it.
        return datasets.Dataset.from_list(rows), len(rows) if len(rows) < wanted else (cfg.data.max_documents or None)
    train, _ = load_splits(source, cfg.data)
    if len(train) == 0:
        raise DataError(Problem("--dataset", source.location, "is empty", "point --dataset at data with documents"))
    return train.select(range(min(SAMPLE_DOCUMENTS, len(train)))), len(train)


def print_report(report: Report, stream=None) -> int:
    import sys

    out = stream or sys.stdout
    for line in report.lines:
        print(line, file=out)
    for note in report.notes:
        print(f"note: {note}", file=out)
    if report.problems:
        print(f"preflight: {len(report.problems)} problem(s):", file=out)
        for p in report.problems:
            print(f"  - {p}", file=out)
        return 2
    print("preflight: OK", file=out)
    return 0


def _check_resume(plan: Plan, report: Report):
    """What is wrong with the plan's resume point, or with --resume."""
    from . import ds_config as dsc
    from .checkpoint import CHECKPOINT_NAME, data_position_problems, needs_universal, universal_command
    from .streaming import stream_resume_problems

    cfg, info = plan.cfg, plan.resume
    if cfg.checkpoint.resume == "never" and any(CHECKPOINT_NAME.match(p.name) for p in cfg.checkpoint.run_dir.root.glob("step-*")):
        report.problems.append(Problem("--resume", cfg.checkpoint.resume, f"{cfg.checkpoint.checkpoint_dir} already holds checkpoints",
                                       "choose another --checkpoint_dir or move them away (nothing is deleted for you)"))
    if info is None:
        return
    m = info.manifest
    report.lines.append(f"resume: from {info.path} (step {m['step']})")
    if plan.ds_config is not None and needs_universal(info, plan.world, dsc.zero_stage(plan.ds_config)):
        report.notes.append(f"{info.path} was saved by {m.get('world_size')} ranks and this run has {plan.world}: it "
                            f"will be converted to a universal checkpoint ({' '.join(universal_command(info))}) "
                            "and loaded with load_universal")
    if m.get("model") not in (None, cfg.model.model):
        report.problems.append(Problem("--model", cfg.model.model, f"{info.path} holds a checkpoint of {m.get('model')}",
                                       f"use --model {m.get('model')}, or another --checkpoint_dir"))
    report.problems += lora_resume_refusals(m, info.path, cfg.model.lora_settings())
    # The data position counts blocks of the checkpoint's seq_len in its tokens: another block length or tokenizer
    # would continue at another place (the data themselves are compared when the run has read them).
    identity = {"seq_len": plan.seq_len, "tokenizer": cfg.model.tokenizer}
    if plan.tokenizer is not None:
        from .concat_dataset import tokenizer_identity
        identity["tokenizer_identity"] = tokenizer_identity(plan.tokenizer)
    report.problems += data_position_problems(m, info.path, identity)
    report.problems += stream_resume_problems(m, info.path, cfg.data.streaming, cfg.data.stream_shuffle_blocks,
                                              plan.world)


def lora_resume_refusals(manifest: dict, path, settings) -> list[Problem]:
    """A checkpoint continues with the adapters it was trained with, and a full fine-tuning checkpoint without any."""
    from .lora import LoraSettings, lora_resume_problems

    recorded = manifest.get("lora")
    if settings is not None:
        return lora_resume_problems(recorded, settings, str(path))
    if recorded is not None:
        before = LoraSettings.from_manifest(recorded)
        return [Problem("--lora_rank", 0, f"{path} holds LoRA adapters (rank {before.rank}, alpha {before.alpha:g}) "
                        "without the frozen weights", f"resume with --lora_rank {before.rank} --lora_alpha "
                        f"{before.alpha:g}" + (f" --lora_target_modules {','.join(before.target_modules)}"
                                               if before.target_modules else "")
                        + ", or start a new run in another --checkpoint_dir")]
    return []


def merge_rank_problems(per_rank: list[tuple[str, list[Problem]]]) -> list[Problem]:
    """Every rank's problems as one list, from (host, problems) per rank: rank 0's first, then each one that only
    other ranks found (a node's GPU, disk or environment), once, named by the first rank and host that found it."""
    merged, seen = [], set()
    for rank, (host, problems) in enumerate(per_rank):
        for p in problems:
            if str(p) in seen:
                continue
            seen.add(str(p))
            merged.append(p if rank == 0 else Problem(p.setting, p.value, f"{p.message} (rank {rank} on {host})", p.fix))
    return merged


def raise_on_problems(report: Report):
    if report.problems:
        raise ConfigError(report.problems)
