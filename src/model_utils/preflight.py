"""Preflight: check everything a run needs in seconds, on a login node, before GPUs are allocated.

`python src/train_deepspeed.py ... --preflight` prints the effective configuration and the plan, then every problem at
once (setting, bad value, fix) and exits 0 or 2. `setup()` runs the same checks at the start of every real run.
Nothing here builds the model or tokenizes the whole dataset: the model is sized from its config on the meta device,
the data is checked on a sample (or read from the packed cache when it exists).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from .arguments import ConfigError, Problem, TrainConfig, validate_args
from .ds_config import suggest

GIB = 1024**3
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


# ----------------------------------------------------------------------------------------------------------------------
# Memory: ZeRO paper's model-state formulas plus activations
# ----------------------------------------------------------------------------------------------------------------------
@dataclass
class MemoryPlan:
    label: str
    zero_stage: int
    offload_optimizer: bool
    offload_param: bool
    micro_batch: int
    gradient_checkpointing: bool


def model_state_bytes(params: int, world: int, stage: int, offload_opt: bool, offload_param: bool, bf16: bool) -> float:
    """Per-GPU bytes of parameters, gradients and Adam state (Rajbhandari et al., mixed precision: 2+2+12 bytes/param)."""
    p_bytes, g_bytes, opt_bytes = (2, 2, 12) if bf16 else (4, 4, 8)
    params_b = p_bytes * params / (world if stage >= 3 else 1)
    grads_b = g_bytes * params / (world if stage >= 2 else 1)
    opt_b = 0 if offload_opt else opt_bytes * params / (world if stage >= 1 else 1)
    if offload_param and stage == 3:
        params_b = 0
    return params_b + grads_b + opt_b


def activation_bytes(config, seq_len: int, micro: int, checkpointing: bool, fused_ce: bool, bf16: bool,
                     chunk_budget: int) -> float:
    """Korthikanti et al. with flash attention: ~34·s·b·h bytes per layer (16-bit), sized up for Qwen3's 3h MLP and GQA;
    full recomputation keeps only each layer's input (2·s·b·h) plus one layer's working set. Logits: 16-bit logits,
    their fp32 upcast and its gradient, unless the fused linear cross-entropy avoids them."""
    h, layers = config.hidden_size, config.num_hidden_layers
    mlp_ratio = config.intermediate_size / h
    per_layer = micro * seq_len * h * (10 + 8 * mlp_ratio)
    scale = 1 if bf16 else 2
    acts = (layers * 2 * micro * seq_len * h + per_layer) if checkpointing else layers * per_layer
    # Fused: one chunk of transient 16-bit logits (the chunk budget, --flce_chunk_budget, in hidden-state sizes).
    logits = (chunk_budget * micro * seq_len * h * 2 if fused_ce
              else micro * seq_len * config.vocab_size * (2 + 4 + 4))
    return acts * scale + logits


def evaluation_bytes(config, seq_len: int, micro: int, bf16: bool) -> float:
    """Evaluation's working memory beyond the model states (model_utils.evaluation): a forward without gradients keeps
    one layer's working set, the final hidden states, and one chunk of logits (16-bit, their fp32 upcast and the
    cross-entropy's log-probabilities), never the whole batch's."""
    from .evaluation import CHUNK_TOKENS

    h, scale = config.hidden_size, 1 if bf16 else 2
    layer = micro * seq_len * h * (10 + 8 * config.intermediate_size / h) * scale
    return layer + micro * seq_len * h * 2 * scale + min(CHUNK_TOKENS, micro * seq_len) * config.vocab_size * 10


def largest_parameter_bytes(config, bf16: bool) -> float:
    """The largest single tensor a ZeRO-3 export gathers on a GPU at once: the embedding or the LM head."""
    return config.vocab_size * config.hidden_size * (2 if bf16 else 4)


@dataclass
class PhaseMemory:
    """Estimated peak bytes per GPU in each phase of a run; the run needs the largest."""

    train: float
    evaluation: float
    export: float
    generation: float

    @property
    def peak(self) -> tuple[str, float]:
        return max(vars(self).items(), key=lambda item: item[1])


def phase_memory(num_params: int, mconf, world: int, seq_len: int, micro: int, stage: int, off_opt: bool,
                 off_par: bool, bf16: bool, zero: dict, checkpointing: bool, fused: bool, chunk: int,
                 generate: bool) -> PhaseMemory:
    states = model_state_bytes(num_params, world, stage, off_opt, off_par, bf16)
    return PhaseMemory(
        train=states + bucket_bytes(zero, stage, off_opt, bf16)
        + activation_bytes(mconf, seq_len, micro, checkpointing, fused, bf16, chunk),
        evaluation=states + evaluation_bytes(mconf, seq_len, micro, bf16),
        export=states + (largest_parameter_bytes(mconf, bf16) if stage == 3 else 0.0),
        # rank 0 loads the exported model (16-bit) for --generate_prompt while the engine still holds its states
        generation=states + num_params * 2 if generate else 0.0)


def bucket_bytes(zero: dict, stage: int, offload_optimizer: bool, bf16: bool) -> float:
    """ZeRO-1/2 gradient reduction buckets: reduce_bucket_size elements of the gradients' dtype, doubled with
    overlap_comm; none under ZeRO-3 or with the optimizer offloaded. `zero` is the zero_optimization section."""
    elements = zero.get("reduce_bucket_size", 5e8)
    if stage not in (1, 2) or offload_optimizer or not isinstance(elements, (int, float)):
        return 0.0
    return float(elements) * (2 if bf16 else 4) * (2 if zero.get("overlap_comm") else 1)


@dataclass
class Report:
    lines: list[str] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    estimates: list[str] = field(default_factory=list)  # the memory and disk lines, which a starting run also logs
    # What the checks loaded and resolved, for the run to use instead of doing it again.
    tokenizer: object = None
    model_config: object = None
    ds_config: dict | None = None
    seq_len: int | None = None
    resume: object = None  # checkpoint.CheckpointInfo of the checkpoint to resume from, or None
    background_checkpoint: bool = False  # --background_checkpoint, and this node's memory holds a host copy

    def estimate(self, line: str) -> None:
        self.lines.append(line)
        self.estimates.append(line)


def gpu_memory_gib() -> tuple[float | None, str]:
    import torch

    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return props.total_memory / GIB, props.name
    override = os.environ.get("GPU_MEMORY_GIB")
    return (float(override), "GPU_MEMORY_GIB") if override else (None, "no GPU visible here")


def planned_world_size() -> int:
    """What the run will have: the launchers export WORLD_SIZE (nodes x GPUs per node) for the preflight."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def run_preflight(cfg: TrainConfig, world_size: int | None = None, check_data: bool = True,
                  on_training_hardware: bool = False, scan_checkpoints: bool = True) -> Report:
    """Every check; `on_training_hardware` (the run's own start) decides bf16 "auto" by this machine, where a login
    node without GPUs assumes the GPU nodes support it. `scan_checkpoints` False skips reading the existing
    checkpoints (a run's ranks other than 0: rank 0 chooses the resume point for all)."""
    missing = [name for name in ("torch", "deepspeed", "transformers") if importlib.util.find_spec(name) is None]
    if missing:
        return config_only_preflight(cfg, world_size or planned_world_size(), missing)
    import torch

    from . import ds_config as dsc
    from .levers import fused_kernels_problem, liger_available, use_fused_kernels
    from .models import (FlopsModel, check_vocab_covers_tokenizer, default_seq_len, masks_documents_by_position,
                         model_config, tokenizer_source)
    from .tokenizer import load_tokenizer
    from .train_utils import bf16_supported

    report = Report()
    world = world_size or planned_world_size()
    cuda = torch.cuda.is_available()
    report.problems += validate_args(cfg)

    # --- DeepSpeed config ---
    ds_path = cfg.resolved_ds_config_path()
    raw, problems = dsc.load_json(ds_path) if ds_path.is_file() else (None, [])  # a missing file: validate_args
    report.problems += problems

    # --- tokenizer and model ---
    tokenizer = mconf = None
    try:
        tokenizer = load_tokenizer(tokenizer_source(cfg.tokenizer, cfg.model))
    except (OSError, ValueError) as e:
        report.problems.append(Problem("--tokenizer", cfg.tokenizer or cfg.model, f"could not be loaded: {e}".split("\n")[0],
                                       "pass a local tokenizer directory or a hub id reachable from here"))
    if tokenizer is not None:
        try:
            mconf = model_config(cfg.model, tokenizer)
        except (OSError, ValueError) as e:
            report.problems.append(Problem("--model", cfg.model, f"could not be loaded: {e}".split("\n")[0],
                                           "use a preset (tiny, qwen3-0.6b, qwen3-1.7b, qwen3-4b, qwen3-8b), a model "
                                           "directory with config.json, or a reachable hub id"))
    seq_len = cfg.seq_len or default_seq_len(cfg.model)
    if mconf is not None:
        p = check_vocab_covers_tokenizer(mconf, tokenizer, cfg.model, cfg.tokenizer)
        if p:
            report.problems.append(p)
        max_pos = getattr(mconf, "max_position_embeddings", None)
        if max_pos and seq_len > max_pos:
            report.problems.append(Problem("--seq_len", seq_len, f"exceeds the model's max_position_embeddings ({max_pos})",
                                           f"use --seq_len {max_pos} or less"))
        if cfg.document_mask and not masks_documents_by_position(mconf):
            report.problems.append(Problem("--document_mask", True, f"this model ({type(mconf).__name__}) does not build "
                                           "its attention mask with transformers' create_causal_mask, which turns "
                                           "restarting positions into a mask per document",
                                           "leave out --document_mask (documents are then separated by EOS only)"))
        if cfg.document_mask and tokenizer.eos_token_id is None:
            report.problems.append(Problem("--document_mask", True, "the tokenizer has no EOS token to end documents",
                                           "use a tokenizer with an eos_token, or leave out --document_mask"))
    p = fused_kernels_problem(cfg.perf, cuda)
    if p:
        report.problems.append(p)

    ds = None
    if raw is not None:
        report.problems += check_known_keys(raw)
        # A login node without GPUs assumes GPU nodes with bf16; the run's own start checks its hardware.
        hardware = dsc.hardware_precision(cuda, bf16_supported()) if cuda or on_training_hardware else "bf16"
        ds, notes, problems = dsc.resolve(raw, cfg, world, hardware, mconf.hidden_size if mconf else None)
        report.notes += notes
        report.problems += problems
        if not (cuda or on_training_hardware) and raw.get("bf16", {}).get("enabled") is True:
            report.notes.append("bf16 is on: the GPU nodes must support it (A100/H100 or newer); not checkable here")

    # --- model size, plan, memory ---
    num_params = None
    if mconf is not None:
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            meta_model = AutoModelForCausalLM.from_config(mconf)
        num_params = sum(p.numel() for p in meta_model.parameters())
        del meta_model
    if ds is not None and not any(pr.setting.startswith(("train_", "gradient_acc")) for pr in report.problems):
        batch = dsc.Batch.of(ds, world, seq_len)
        micro = batch.micro
        stage = dsc.zero_stage(ds)
        off_opt, off_par = dsc.offloads(ds)
        bf16 = dsc.precision(ds) != "fp32"  # 16-bit weights and gradients: bf16 or fp16, the same sizes
        report.lines.append("effective DeepSpeed config:\n" + json.dumps(ds, indent=2))
        report.lines.append(f"batch: {batch.describe()}")
        report.lines.append(f"plan: {batch.plan(cfg.max_steps)}")
        if num_params:
            flops = FlopsModel.from_config(mconf, num_params, seq_len).per_token()
            report.lines.append(f"model: {cfg.model}, {num_params / 1e6:,.1f}M parameters, {flops / 1e9:.2f} GFLOP/token, "
                                f"ZeRO stage {stage}{', optimizer offload' if off_opt else ''}"
                                f"{', parameter offload' if off_par else ''}")
            # Where the run starts, the fused loss is what this machine can run; on a login node, what the GPU nodes
            # will run by default (the run's own start checks again with what they have).
            here = cuda or on_training_hardware
            fused = use_fused_kernels(cfg.perf.fused_kernels, cuda) if here else cfg.perf.fused_kernels != "off"
            chunk = cfg.perf.flce_chunk_budget
            zero = ds.get("zero_optimization", {})
            phases = phase_memory(num_params, mconf, world, seq_len, micro, stage, off_opt, off_par, bf16, zero,
                                  cfg.gradient_checkpointing, fused, chunk, bool(cfg.generate_prompt and cfg.export))
            peak_phase, total = phases.peak
            memory, where = gpu_memory_gib()
            report.estimate(f"memory: ~{total / GIB:.1f} GiB per GPU estimated, at its peak in {peak_phase} (train "
                            f"step {phases.train / GIB:.1f}: model states, ZeRO buckets, activations; evaluation "
                            f"{phases.evaluation / GIB:.1f}; export {phases.export / GIB:.1f}"
                            + (f"; generation {phases.generation / GIB:.1f}" if phases.generation else "")
                            + f"); GPU: {f'{memory:.0f} GiB' if memory else where}")
            if fused and not here and not liger_available():
                logits = activation_bytes(mconf, seq_len, micro, False, False, bf16, chunk) - activation_bytes(
                    mconf, seq_len, micro, False, True, bf16, chunk)
                report.estimate(f"memory: assumes Liger's fused cross-entropy on the GPU nodes (not installed "
                                f"here); without it the logits add ~{logits / GIB:.0f} GiB")
            if memory and 0.92 * memory * GIB < total <= memory * GIB:
                report.notes.append(f"the memory estimate is within 8% of the GPU's {memory:.0f} GiB: expect little headroom")
            if memory and total > memory * GIB and peak_phase == "generation":
                report.problems.append(Problem(
                    "--generate_prompt", cfg.generate_prompt, f"loading the exported model for the sample needs "
                    f"~{total / GIB:.0f} GiB per GPU beside the engine, more than the {memory:.0f} GiB available",
                    "drop --generate_prompt and run `python -m model_utils.generate --model EXPORT_DIR` after the run"))
            elif memory and total > memory * GIB:
                report.problems.append(Problem(
                    "train_micro_batch_size_per_gpu / zero_optimization", f"micro {micro}, ZeRO {stage}",
                    f"needs ~{total / GIB:.0f} GiB per GPU, more than the {memory:.0f} GiB available",
                    _cheapest_fit(num_params, mconf, world, seq_len, micro, bf16, fused, chunk, memory, zero)))
            ckpt_bytes = num_params * (2 + 12 if bf16 else 4 + 8) * 1.05
            _check_checkpoint_dir(cfg, ckpt_bytes, report)
            _plan_background_writes(cfg, ckpt_bytes, world, off_opt or off_par, report)
        if check_data:
            _check_data(cfg, tokenizer, seq_len, world, micro, report)

    # --- existing checkpoints ---
    info = _check_resume(cfg, ds, world, seq_len, report) if scan_checkpoints else None
    report.tokenizer, report.model_config, report.ds_config = tokenizer, mconf, ds
    report.seq_len, report.resume = seq_len, info
    return report


def config_only_preflight(cfg: TrainConfig, world: int, missing: list[str]) -> Report:
    """The checks a machine without torch/DeepSpeed can make (a login node): the arguments, the DeepSpeed config's
    JSON, its "auto" values and batch arithmetic; the report says what was left unchecked."""
    from . import ds_config as dsc

    report = Report()
    report.problems += validate_args(cfg)
    ds_path = cfg.resolved_ds_config_path()
    raw, problems = dsc.load_json(ds_path) if ds_path.is_file() else (None, [])
    report.problems += problems
    if raw is not None:
        ds, notes, problems = dsc.resolve(raw, cfg, world, "bf16", None, check_classes=False)
        report.notes += notes
        report.problems += problems
        if not any(p.setting.startswith(("train_", "gradient_acc")) for p in problems):
            batch = dsc.Batch.of(ds, world, cfg.seq_len or 0)  # the block length needs the model: not known here
            report.lines.append("effective DeepSpeed config:\n" + json.dumps(ds, indent=2))
            report.lines.append(f"batch: micro {batch.micro} x grad_acc {batch.accumulation} x world {world} = "
                                f"{batch.blocks_per_step} blocks per step; {cfg.max_steps} steps")
    report.notes.append(f"{', '.join(missing)} not installed here: checked the arguments and the DeepSpeed config's "
                        "JSON, batch and schedule; not checked: DeepSpeed key names, optimizer and scheduler "
                        "parameters, tokenizer, model, memory, data and checkpoints (pip install -e . here checks "
                        "them too; the run's own start checks them on the GPU nodes)")
    return report


def _cheapest_fit(params, mconf, world, seq_len, micro, bf16, fused, chunk, memory_gib, zero: dict) -> str:
    """The first configuration, in order of speed, whose estimate fits in 92% of the GPU."""
    candidates = []
    m = micro
    while m > 1:
        m //= 2
        candidates.append(MemoryPlan(f"train_micro_batch_size_per_gpu {m} (raise gradient_accumulation_steps to keep "
                                     f"the batch)", 2, False, False, m, False))
    candidates += [MemoryPlan("--gradient_checkpointing", 2, False, False, micro, True),
                   MemoryPlan("--gradient_checkpointing with micro-batch 1", 2, False, False, 1, True),
                   MemoryPlan("DS_CONFIG=configs/zero3.json with --gradient_checkpointing", 3, False, False, micro, True),
                   MemoryPlan("DS_CONFIG=configs/zero2-offload.json with --gradient_checkpointing", 2, True, False, micro, True),
                   MemoryPlan("DS_CONFIG=configs/zero3-offload.json with --gradient_checkpointing and micro-batch 1",
                              3, True, True, 1, True)]
    for plan in candidates:
        need = (model_state_bytes(params, world, plan.zero_stage, plan.offload_optimizer, plan.offload_param, bf16)
                + bucket_bytes(zero, plan.zero_stage, plan.offload_optimizer, bf16)
                + activation_bytes(mconf, seq_len, plan.micro_batch, plan.gradient_checkpointing, fused, bf16, chunk))
        if need <= 0.92 * memory_gib * GIB:
            return f"cheapest configuration that fits (~{need / GIB:.0f} GiB): {plan.label}"
    return "nothing fits on this many GPUs: use more GPUs (ZeRO-3 divides the model states by their number)"


def _check_checkpoint_dir(cfg: TrainConfig, ckpt_bytes: float, report: Report):
    path = Path(cfg.checkpoint_dir)
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        report.problems.append(Problem("--checkpoint_dir", cfg.checkpoint_dir, f"{probe} is a file, not a directory",
                                       "choose a directory path (on a filesystem all nodes share)"))
        return
    if not os.access(probe, os.W_OK):
        report.problems.append(Problem("--checkpoint_dir", cfg.checkpoint_dir, f"{probe} is not writable",
                                       "choose a directory you can write to (on a filesystem all nodes share)"))
        return
    # Periodic saves (by steps or by the clock) keep K complete checkpoints plus the one being written; without them
    # the run saves only at the end (or on a stop signal): one checkpoint. Keeping all (K = 0) by the clock alone:
    # at least two.
    if cfg.checkpoint_freq or cfg.checkpoint_minutes:
        keep = cfg.keep_last_checkpoints or (max(1, cfg.max_steps // cfg.checkpoint_freq) if cfg.checkpoint_freq else 1)
    else:
        keep = 0
    count = keep + 1
    need = ckpt_bytes * count
    free = shutil.disk_usage(probe).free
    report.estimate(f"checkpoints: ~{ckpt_bytes / GIB:.2f} GiB each, {count} on disk at most; "
                    f"{free / GIB:,.0f} GiB free in {probe}")
    if need > free:
        report.problems.append(Problem("--keep_last_checkpoints", cfg.keep_last_checkpoints,
                                       f"{count} checkpoint(s) need ~{need / GIB:.0f} GiB, {free / GIB:.0f} GiB are free",
                                       "free space, keep fewer checkpoints, or use another --checkpoint_dir"))


def host_memory_available() -> float | None:
    """Bytes of memory this machine can still give (MemAvailable), None where /proc/meminfo is not there."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return float(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _plan_background_writes(cfg: TrainConfig, ckpt_bytes: float, world: int, offloaded: bool, report: Report):
    """--background_checkpoint copies each rank's share of a checkpoint to host memory: on when a node's copy, beside
    the optimizer states an offload keeps there, fits in 3/4 of the memory this node has available."""
    if not cfg.background_checkpoint:
        report.estimate("checkpoint writes: synchronous (--no-background_checkpoint)")
        return
    import torch

    per_node = world if not torch.cuda.is_available() else min(world, torch.cuda.device_count())
    copy = ckpt_bytes * per_node / world
    need = copy * (2 if offloaded else 1)  # the offloaded states (~ the checkpoint's size) live in host memory too
    available = host_memory_available()
    if available is not None and need > 0.75 * available:
        report.estimate(f"checkpoint writes: synchronous: the host copy (~{copy / GIB:.1f} GiB per node"
                        + (", beside the offloaded optimizer states" if offloaded else "")
                        + f") does not fit in 3/4 of the {available / GIB:.0f} GiB available")
        return
    report.background_checkpoint = True
    report.estimate(f"checkpoint writes: in the background, from a host copy of ~{copy / GIB:.1f} GiB per node"
                    + (f" ({available / GIB:.0f} GiB available)" if available is not None else ""))


def _check_data(cfg, tokenizer, seq_len, world, micro, report: Report):
    """Resolve the dataset and check the column and tokenization on a sample; exact counts from the cache if built."""
    from .concat_dataset import (DUMMY_VALIDATION_FRACTION, DataError, block_count, cache_dir_for, held_out_count,
                                 resolve_source, tokenize_split)

    if cfg.dummy_data:
        report.lines.append(f"data: dummy, {cfg.dummy_data} random blocks")
        blocks = cfg.dummy_data - held_out_count(cfg.dummy_data, DUMMY_VALIDATION_FRACTION)
    elif tokenizer is None:
        return
    else:
        try:
            source = resolve_source(cfg)
            cache = cache_dir_for(cfg, source, tokenizer)
            if (cache / "meta.json").exists():
                meta = json.loads((cache / "meta.json").read_text())
                tokens = meta["tokens"]["train"]
                report.lines.append(f"data: {source.location}: {tokens:,} tokens (packed cache {cache})")
                blocks = block_count(tokens, seq_len)
                if "validation" not in meta["tokens"]:
                    blocks -= held_out_count(blocks, cfg.validation_fraction)
            else:
                sample, total_docs = _sample(source, cfg)
                tokenized = tokenize_split(sample, tokenizer, cfg.text_column, 1, "train (sample)")
                sample_tokens = sum(len(x) for x in tokenized["input_ids"])
                if sample_tokens == 0:
                    raise DataError(Problem("--text_column", cfg.text_column, "the sampled documents hold no text",
                                            "check the column's contents"))
                est = sample_tokens * (total_docs / len(sample)) if total_docs else None
                report.lines.append(f"data: {source.location}: column '{cfg.text_column}' present; "
                                    f"~{est:,.0f} tokens estimated from {len(sample)} documents" if est else
                                    f"data: {source.location}: column '{cfg.text_column}' present (streamed sample)")
                blocks = int(est // seq_len) if est else None
        except DataError as e:
            report.problems.append(e.problem)
            return
    if blocks is not None and blocks < world * micro:
        report.problems.append(Problem("--seq_len", seq_len, f"the data gives ~{blocks} training blocks, fewer than one "
                                       f"micro-batch per rank ({micro} x {world} ranks)",
                                       "use more data, a smaller --seq_len or a smaller micro-batch"))


def _sample(source, cfg):
    import datasets

    from .concat_dataset import LOAD_ERRORS, DataError, load_problem, load_splits, stream_documents

    if source.kind == "hub":
        try:
            wanted = min(SAMPLE_DOCUMENTS, cfg.max_documents or SAMPLE_DOCUMENTS)
            rows = list(stream_documents(source.location, cfg.dataset_config_name, None, "train", wanted))
        except LOAD_ERRORS as e:
            raise load_problem(source, e) from e
        if not rows:
            raise DataError(Problem("--dataset", source.location, "is empty", "point --dataset at data with documents"))
        # The document count is known when the sample holds them all, or when --max_documents caps it.
        return datasets.Dataset.from_list(rows), len(rows) if len(rows) < wanted else (cfg.max_documents or None)
    train, _ = load_splits(source, cfg)
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


def _check_resume(cfg: TrainConfig, ds: dict | None, world: int, seq_len: int, report: Report):
    """The checkpoint this run resumes from (None: a fresh start), and what is wrong with it or with --resume."""
    from . import ds_config as dsc
    from .checkpoint import TAG_RE, ResumeError, find_resume_checkpoint, needs_universal, resolve_explicit, universal_command

    if cfg.resume == "never" and any(TAG_RE.match(p.name) for p in Path(cfg.checkpoint_dir).glob("step-*")):
        report.problems.append(Problem("--resume", cfg.resume, f"{cfg.checkpoint_dir} already holds checkpoints",
                                       "choose another --checkpoint_dir or move them away (nothing is deleted for you)"))
    try:
        info = (resolve_explicit(Path(cfg.resume_from_checkpoint), report.notes.append) if cfg.resume_from_checkpoint
                else find_resume_checkpoint(Path(cfg.checkpoint_dir), report.notes.append) if cfg.resume == "auto" else None)
    except (ResumeError, OSError) as e:  # an unreadable directory too: every rank waits for rank 0's verdict
        lines = str(e).splitlines()
        message = "\n      ".join(lines[:-1]) if len(lines) > 1 else lines[0]  # keep the list of damaged files
        report.problems.append(Problem("--checkpoint_dir", cfg.checkpoint_dir, message,
                                       "remove the damaged checkpoints listed, or use another --checkpoint_dir"))
        return None
    if info is not None:
        m = info.manifest
        report.lines.append(f"resume: from {info.path} (step {m['step']})")
        if ds is not None and needs_universal(info, world, dsc.zero_stage(ds)):
            report.notes.append(f"{info.path} was saved by {m.get('world_size')} ranks and this run has {world}: it "
                                f"will be converted to a universal checkpoint ({' '.join(universal_command(info))}) "
                                "and loaded with load_universal")
        if m.get("model") not in (None, cfg.model):
            report.problems.append(Problem("--model", cfg.model, f"{info.path} holds a checkpoint of {m.get('model')}",
                                           f"use --model {m.get('model')}, or another --checkpoint_dir"))
        if m.get("seq_len") not in (None, seq_len):
            report.notes.append(f"the checkpoint was trained with seq_len {m.get('seq_len')}, this run uses {seq_len}")
    return info


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
