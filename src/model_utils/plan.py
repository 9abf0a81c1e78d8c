"""The plan of a run: one pass from the configuration to everything the run is built from.

`make_plan` loads the tokenizer and the model's config, resolves the DeepSpeed config (flags, "auto", the precision the
hardware has), the batch (the micro-batch, automatic by the memory estimate where asked; accumulation derived from the
global batch), sizes the model on the meta device, estimates each phase's GPU memory, decides how checkpoints are
written, and, on the rank that decides for all, finds the resume point and the data source. The preflight
(`preflight.check_plan`) checks and prints a plan; `setup()` builds the run from the same plan. What cannot be resolved
is a Problem in `plan.problems`; nothing here builds the model or reads the data.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from .arguments import Problem, TrainConfig, validate_args
from .memory import GIB, PhaseMemory, choose_micro_batch, phase_memory


@dataclass
class Plan:
    cfg: TrainConfig
    world: int  # data-parallel ranks the run has (or will have: the launchers export WORLD_SIZE)
    here: bool  # planned on the training hardware (a run's start, or a GPU node): levers and memory are this machine's
    raw_ds_config: dict | None = None  # ds_config.json as written
    ds_config: dict | None = None  # resolved: flags applied, no "auto" left
    tokenizer: object = None
    model_config: object = None
    seq_len: int = 0
    batch: object = None  # ds_config.Batch
    micro_batch_choice: str | None = None  # how "auto" chose the micro-batch; None where it was given
    num_params: int | None = None
    param_groups: list[list[int]] = field(default_factory=list)  # the optimizer's groups' parameter sizes
    flops: object = None  # models.FlopsModel
    fused_loss: bool = False  # Liger's fused linear cross-entropy (the logits' memory depends on it)
    compiled_layers: bool = False  # torch.compile'd decoder layers (they keep fewer activations); not under ZeRO-3
    checkpointable_layers: int = 0  # the model's layers transformers checkpoints one by one (models.checkpointable_layers)
    checkpointed_layers: int | None = None  # decoder layers --gradient_checkpointing recomputes (None: it is off)
    checkpointed_layers_choice: str | None = None  # how --checkpointed_layers auto chose; None where it was given
    delayed_prefetch: bool = False  # the delayed update's second GPU buffer (--delayed_update_prefetch, resolved)
    delayed_prefetch_choice: str | None = None  # how --delayed_update_prefetch auto chose; None where it was not asked
    memory: PhaseMemory | None = None
    gpu_memory_gib: float | None = None
    gpu_memory_source: str = ""  # the GPU's name, GPU_MEMORY_GIB, or why no size is known
    host_bytes: float = 0.0  # host memory per node for the offloaded states (0 without offload)
    resume_host_bytes: float = 0.0  # what a node needs beyond host_bytes while it loads a checkpoint
    host_available: float | None = None  # this node's MemAvailable where the run starts; None on a login node
    ranks_per_node: int = 1
    checkpoint_bytes: float = 0.0  # one checkpoint on disk (16-bit weights, fp32 master weights and Adam moments)
    background_checkpoint: bool = False  # --background_checkpoint, and this node's memory holds a host copy
    checkpoint_writes: str = ""  # how checkpoints are written, and why
    resume: object = None  # checkpoint.CheckpointInfo to resume from; None: a fresh start (or not the deciding rank)
    incomplete_moved: list[str] = field(default_factory=list)  # incomplete checkpoints moved aside by this start
    data_source: object = None  # concat_dataset.DataSource; None for --dummy_data or on other ranks than the deciding one
    problems: list[Problem] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def resolved(self) -> bool:
        """The DeepSpeed config, the batch and the model are known: the plan can be sized and built."""
        return self.ds_config is not None and self.batch is not None and self.model_config is not None


def gpu_memory_gib() -> tuple[float | None, str]:
    """This machine's GPU memory, or GPU_MEMORY_GIB (planning for the GPU nodes from a login node)."""
    import torch

    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return props.total_memory / GIB, props.name
    override = os.environ.get("GPU_MEMORY_GIB")
    return (float(override), "GPU_MEMORY_GIB") if override else (None, "no GPU visible here")


def host_memory_available() -> float | None:
    """Bytes of memory this machine can still give (MemAvailable), None where /proc/meminfo is not there."""
    from pathlib import Path

    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return float(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def make_plan(cfg: TrainConfig, world: int, on_training_hardware: bool = False, decides: bool = True,
              move_incomplete: bool = False) -> Plan:
    """Resolve everything the run needs. `on_training_hardware` (a run's own start) decides bf16 "auto" and the fused
    loss by this machine, where a login node without GPUs assumes GPU nodes that have them. `decides` False (a run's
    ranks other than 0) leaves the resume point and the data source to the deciding rank. `move_incomplete` (the
    deciding rank of a run, holding the run lock) moves incomplete checkpoints aside; a preflight only names them."""
    import torch

    from . import ds_config as dsc
    from .levers import use_fused_kernels
    from .models import default_seq_len, model_config, tokenizer_source
    from .tokenizer import load_tokenizer
    from .train_utils import bf16_supported

    cuda = torch.cuda.is_available()
    plan = Plan(cfg, world, here=cuda or on_training_hardware)
    plan.problems += validate_args(cfg)
    plan.seq_len = cfg.seq_len or default_seq_len(cfg.model)
    plan.gpu_memory_gib, plan.gpu_memory_source = gpu_memory_gib()
    # Where the run starts, the fused loss is what this machine can run; on a login node, what the GPU nodes will run
    # by default (the run's own start plans again with what they have).
    plan.fused_loss = use_fused_kernels(cfg.perf.fused_kernels, cuda) if plan.here else cfg.perf.fused_kernels != "off"

    ds_path = cfg.resolved_ds_config_path()
    raw, problems = dsc.load_json(ds_path) if ds_path.is_file() else (None, [])  # a missing file: validate_args
    plan.raw_ds_config = raw
    plan.problems += problems

    try:
        plan.tokenizer = load_tokenizer(tokenizer_source(cfg.tokenizer, cfg.model))
    except (OSError, ValueError) as e:
        plan.problems.append(Problem("--tokenizer", cfg.tokenizer or cfg.model, f"could not be loaded: {e}".split("\n")[0],
                                     "pass a local tokenizer directory or a hub id reachable from here"))
    if plan.tokenizer is not None:
        try:
            plan.model_config = model_config(cfg.model, plan.tokenizer, cfg.attention_dropout)
        except (OSError, ValueError) as e:
            plan.problems.append(Problem("--model", cfg.model, f"could not be loaded: {e}".split("\n")[0],
                                         "use a preset (tiny, qwen3-0.6b, qwen3-1.7b, qwen3-4b, qwen3-8b), a model "
                                         "directory with config.json, or a reachable hub id"))
    if plan.model_config is not None:
        _size_model(plan)

    if raw is not None:
        # A login node without GPUs assumes GPU nodes with bf16; the run's own start checks its hardware.
        hardware = dsc.hardware_precision(cuda, bf16_supported()) if plan.here else "bf16"
        mconf = plan.model_config
        ds, notes, problems = dsc.resolve(raw, cfg, world, hardware, mconf.hidden_size if mconf else None,
                                          seq_len=plan.seq_len, choose_micro=_micro_chooser(plan))
        plan.notes += notes
        plan.problems += problems
        if not any(p.setting.startswith(dsc.BATCH_SETTINGS) for p in problems):
            plan.ds_config = ds
            plan.batch = dsc.Batch.of(ds, world, plan.seq_len)
        if not plan.here and raw.get("bf16", {}).get("enabled") is True:
            plan.notes.append("bf16 is on: the GPU nodes must support it (A100/H100 or newer); not checkable here")
    if plan.resolved and plan.num_params:
        plan.compiled_layers = _compiles(plan, plan.ds_config)
        _choose_checkpointed_layers(plan)
        _choose_prefetch(plan)
        plan.memory = _phase_memory(plan, plan.ds_config, plan.batch.micro, plan.checkpointed_layers,
                                    plan.delayed_prefetch)
        bf16 = dsc.precision(plan.ds_config) != "fp32"  # 16-bit weights and gradients: bf16 or fp16, the same sizes
        plan.checkpoint_bytes = plan.num_params * (2 + 12 if bf16 else 4 + 8) * 1.05
        _plan_host_memory(plan)
        _plan_checkpoint_writes(plan)
    if decides:
        _find_resume_point(plan, move_incomplete)
        _find_data_source(plan)
    return plan


def _size_model(plan: Plan) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from .models import FlopsModel, checkpointable_layers, decay_groups

    with torch.device("meta"):
        meta_model = AutoModelForCausalLM.from_config(plan.model_config)
    plan.num_params = sum(p.numel() for p in meta_model.parameters())
    plan.checkpointable_layers = len(checkpointable_layers(meta_model))
    plan.param_groups = [[p.numel() for p in group] for group in decay_groups(meta_model.parameters())]
    del meta_model
    plan.flops = FlopsModel.from_config(plan.model_config, plan.num_params, plan.seq_len)


def _compiles(plan: Plan, ds: dict) -> bool:
    """Whether the run compiles its decoder layers (levers.use_compile): this machine's answer where the run starts; on
    a login node, the GPU nodes'."""
    import torch

    from . import ds_config as dsc
    from .levers import use_compile

    cuda = torch.cuda.is_available() or not plan.here
    return use_compile(cuda, dsc.zero_stage(ds) == 3, plan.cfg.perf)


def _phase_memory(plan: Plan, ds: dict, micro: int, checkpointed_layers: int | None = None,
                  prefetch: bool | None = None) -> PhaseMemory:
    """Each phase's estimated peak per GPU with this (possibly partly resolved) DeepSpeed config and micro-batch;
    with --gradient_checkpointing, `checkpointed_layers` of the layers recompute (None: all of them); `prefetch`: the
    delayed update's second GPU buffer (None: where --delayed_update_prefetch is on, not auto: the micro-batch and the
    layers are chosen without what auto would add only if it still fits)."""
    from . import ds_config as dsc

    if prefetch is None:
        prefetch = plan.cfg.perf.delayed_update_prefetch == "on" and _prefetch_applies(plan, ds)
    off_opt, off_par = dsc.offloads(ds)
    return phase_memory(plan.num_params, plan.model_config, plan.world, plan.seq_len, micro, dsc.zero_stage(ds),
                        off_opt, off_par, dsc.precision(ds) != "fp32", ds.get("zero_optimization", {}),
                        plan.cfg.gradient_checkpointing, plan.fused_loss, plan.cfg.perf.flce_chunk_budget,
                        bool(plan.cfg.generate_prompt and plan.cfg.export),
                        fp32_grad_accumulation=dsc.fp32_grad_accumulation(ds),
                        compiled=_compiles(plan, ds),
                        gpu_optimizer_share=dsc.gpu_optimizer_share(ds, plan.param_groups, plan.world),
                        checkpointed_layers=checkpointed_layers, delayed_prefetch=prefetch,
                        accumulation=dsc.accumulation_at(ds, plan.cfg, plan.world, plan.seq_len, micro))


def _prefetch_applies(plan: Plan, ds: dict) -> bool:
    """Whether the delayed update can keep a second GPU copy of the 16-bit partition: ZeRO-1/2 with the optimizer
    offloaded to the CPU, --delayed_update_from_step, GPUs (this machine's, or those a login node plans for)."""
    import torch

    from . import ds_config as dsc

    return bool(plan.cfg.delayed_update_from_step and dsc.cpu_optimizer_offload(ds) and dsc.zero_stage(ds) in (1, 2)
                and (torch.cuda.is_available() or not plan.here))


def _choose_prefetch(plan: Plan) -> None:
    """--delayed_update_prefetch resolved, after the micro-batch and the recomputed layers. auto: on where the run's
    estimated peak with the second buffer still fits AUTO_MEMORY_SHARE of the GPU (or no GPU size is known), so that
    it never takes a larger micro-batch's or a kept layer's place."""
    from .memory import AUTO_MEMORY_SHARE

    setting = plan.cfg.perf.delayed_update_prefetch
    plan.delayed_prefetch = setting != "off" and _prefetch_applies(plan, plan.ds_config)
    if not plan.delayed_prefetch or setting == "on":
        return
    if plan.gpu_memory_gib is None:
        plan.delayed_prefetch_choice = f"auto: on ({plan.gpu_memory_source}: no GPU size to fill)"
        return
    need = _phase_memory(plan, plan.ds_config, plan.batch.micro, plan.checkpointed_layers, prefetch=True).peak[1]
    budget = AUTO_MEMORY_SHARE * plan.gpu_memory_gib * GIB
    plan.delayed_prefetch = need <= budget
    plan.delayed_prefetch_choice = (f"auto: {'on' if plan.delayed_prefetch else 'off'}, ~{need / GIB:.1f} GiB with "
                                    f"it, {AUTO_MEMORY_SHARE:.0%} of the GPU is {budget / GIB:.1f}")


def _choose_checkpointed_layers(plan: Plan) -> None:
    """--checkpointed_layers resolved to a count. auto: the fewest recomputed layers with which the run's estimated
    peak fits AUTO_MEMORY_SHARE of the GPU at the micro-batch chosen with all of them recomputed (so "auto" micro-batch
    and layers together never pick a smaller micro-batch than all layers would); all where no GPU size is known."""
    from .memory import AUTO_MEMORY_SHARE

    cfg, layers = plan.cfg, plan.model_config.num_hidden_layers
    if not cfg.gradient_checkpointing:
        return
    wanted = cfg.checkpointed_layers
    if wanted != "all" and plan.checkpointable_layers != layers:
        plan.problems.append(Problem("--checkpointed_layers", wanted,
                                     f"needs layers transformers checkpoints one by one: {cfg.model} has "
                                     f"{plan.checkpointable_layers} of its {layers}",
                                     "leave --checkpointed_layers at all (every layer recomputes)"))
        wanted = "all"
    if isinstance(wanted, int):
        if wanted > layers:
            plan.problems.append(Problem("--checkpointed_layers", wanted,
                                         f"exceeds the {layers} decoder layers of {cfg.model}",
                                         f"pass at most {layers}, or all"))
        plan.checkpointed_layers = min(wanted, layers)
        return
    plan.checkpointed_layers = layers
    if wanted == "all":
        return
    if plan.gpu_memory_gib is None:
        plan.checkpointed_layers_choice = f"auto: all ({plan.gpu_memory_source}: no GPU size to fill)"
        return
    budget = AUTO_MEMORY_SHARE * plan.gpu_memory_gib * GIB
    for count in range(layers + 1):
        peak = _phase_memory(plan, plan.ds_config, plan.batch.micro, count).peak[1]
        if peak <= budget:
            plan.checkpointed_layers = count
            plan.checkpointed_layers_choice = (
                f"auto: the fewest with which the run fits {AUTO_MEMORY_SHARE:.0%} of the GPU by the estimate "
                f"(~{peak / GIB:.1f} GiB of {plan.gpu_memory_gib:.1f})")
            return
    plan.checkpointed_layers_choice = f"auto: all (fewer do not fit {AUTO_MEMORY_SHARE:.0%} of the GPU)"


def _largest_fitting_micro(plan: Plan, ds: dict, allowed) -> tuple[int, str]:
    """memory.choose_micro_batch for this plan's model on this GPU with `ds` (resolved so far: its ZeRO stage, offloads
    and precision size the model states); the default where no GPU size or model is known."""
    if plan.num_params is None or plan.gpu_memory_gib is None:
        return choose_micro_batch(plan.seq_len, None, None, allowed)
    return choose_micro_batch(plan.seq_len, plan.gpu_memory_gib, lambda m: _phase_memory(plan, ds, m).peak[1], allowed)


def automatic_micro_batch(plan: Plan) -> int | None:
    """The micro-batch "auto" would take for this plan's resolved config and per-rank batch (the largest that divides
    it and fits by the estimate); None where no GPU size is known."""
    if plan.gpu_memory_gib is None or not plan.num_params or not plan.resolved:
        return None
    per_rank = plan.batch.micro * plan.batch.accumulation
    return _largest_fitting_micro(plan, plan.ds_config, lambda m: per_rank % m == 0)[0]


def _micro_chooser(plan: Plan):
    """For ds_config.resolve: the automatic micro-batch, recording how it was chosen."""

    def choose(allowed, ds: dict) -> int:
        micro, plan.micro_batch_choice = _largest_fitting_micro(plan, ds, allowed)
        return micro

    return choose


def _offloaded_host_bytes(plan: Plan, ds: dict) -> float:
    """Host memory a node needs for the states `ds` offloads (memory.offload_host_bytes for this plan's model, world,
    ranks per node and GPU ranks)."""
    import torch

    from . import ds_config as dsc
    from .memory import offload_host_bytes

    return offload_host_bytes(plan.num_params, plan.world, plan.ranks_per_node, dsc.zero_stage(ds), *dsc.offloads(ds),
                              dsc.fp32_grad_accumulation(ds), gpu=torch.cuda.is_available() or not plan.here,
                              gpu_optimizer_share=dsc.gpu_optimizer_share(ds, plan.param_groups, plan.world),
                              pinned_optimizer=bool(dsc.offload_setting(ds, "offload_optimizer", "pin_memory")))


def _plan_host_memory(plan: Plan) -> None:
    """The node's host memory for offloaded optimizer states and parameters, and what this node has (where it runs)."""
    import torch

    from . import ds_config as dsc
    from .memory import resume_host_bytes

    plan.ranks_per_node = plan.world if not torch.cuda.is_available() else min(plan.world, torch.cuda.device_count())
    plan.host_bytes = _offloaded_host_bytes(plan, plan.ds_config)
    plan.resume_host_bytes = resume_host_bytes(
        plan.num_params, plan.world, plan.ranks_per_node, dsc.offloads(plan.ds_config)[0],
        dsc.gpu_optimizer_share(plan.ds_config, plan.param_groups, plan.world))
    plan.host_available = host_memory_available() if plan.here else None


# The share of a node's available memory a proposed offload may plan to fill: the model of the offloaded states came
# within 2% of the measured peaks (docs/PERFORMANCE.md), and the node's other processes and page cache need the rest.
HOST_MEMORY_SHARE = 0.9


def partial_offload_that_fits(plan: Plan, host_available: float) -> tuple[float, str, float, float] | None:
    """For offloaded states that do not fit the node: a ZeRO-3 run with part of its optimizer offloaded, the largest
    `offload_optimizer.ratio` (steps of 0.05) whose host memory fits HOST_MEMORY_SHARE of `host_available` and whose
    GPU part fits AUTO_MEMORY_SHARE of the GPU at micro-batch 1. The parameters stay on the GPU where they fit there
    (offload_param none: each micro-batch would otherwise fetch all of them from host memory twice), and are offloaded
    otherwise. Returns (ratio, offload_param device, host bytes, GPU bytes), or None."""
    import copy

    from .memory import AUTO_MEMORY_SHARE

    if plan.gpu_memory_gib is None or plan.ds_config is None or not plan.param_groups:
        return None
    ds = copy.deepcopy(plan.ds_config)
    ds.pop("data_types", None)  # as configs/zero3-offload.json, which the fix names: gradients accumulate in bf16
    zero = ds.setdefault("zero_optimization", {})
    zero["stage"] = 3
    offload = zero.setdefault("offload_optimizer", {})
    offload["device"] = "cpu"
    for param_device in ("none", "cpu"):
        zero.setdefault("offload_param", {})["device"] = param_device
        for step in range(19, 0, -1):
            offload["ratio"] = step / 20
            host = _offloaded_host_bytes(plan, ds)
            if host > HOST_MEMORY_SHARE * host_available:
                continue
            gpu = _phase_memory(plan, ds, 1).peak[1]
            if gpu <= AUTO_MEMORY_SHARE * plan.gpu_memory_gib * GIB:
                return offload["ratio"], param_device, host, gpu
            break  # a smaller ratio keeps more of the optimizer on the GPU
    return None


def checkpointed_micro_that_fits(plan: Plan) -> tuple[int, float] | None:
    """For a run without activation checkpointing: the automatic micro-batch of the same config and per-rank batch with
    --gradient_checkpointing, and its GPU bytes, where that micro-batch is larger than this run's (under ZeRO-3 with
    the parameters offloaded it fetches them fewer times per step); else None."""
    import dataclasses

    if plan.cfg.gradient_checkpointing:
        return None
    checkpointed = dataclasses.replace(plan, cfg=dataclasses.replace(plan.cfg, gradient_checkpointing=True))
    micro = automatic_micro_batch(checkpointed)
    if micro is None or micro <= plan.batch.micro:  # None: no GPU size known; a micro-batch of 1 where none fits
        return None
    return micro, _phase_memory(checkpointed, plan.ds_config, micro).peak[1]


def _zero2_offload_buckets() -> dict:
    """configs/zero2-offload.json's gradient bucket settings (none where the repository's configs are not at hand)."""
    from .arguments import REPO_ROOT

    path = REPO_ROOT / "configs" / "zero2-offload.json"
    if not path.is_file():
        return {}
    zero = json.loads(path.read_text()).get("zero_optimization", {})
    return {key: zero[key] for key in ("reduce_bucket_size", "overlap_comm", "contiguous_gradients") if key in zero}


def zero2_offload_that_fits(plan: Plan) -> tuple[int, float] | None:
    """For ZeRO-3 with the parameters offloaded: configs/zero2-offload.json's setup (ZeRO-2, the whole optimizer
    offloaded, fp32 gradient accumulation on the GPU) at this world and per-rank batch, which keeps the parameters on
    every GPU and so fetches none from host memory. Returns (its automatic micro-batch, its GPU bytes) where that fits
    the GPU and its host part no more than this config's, else None."""
    import copy

    from . import ds_config as dsc
    from .memory import AUTO_MEMORY_SHARE

    if plan.gpu_memory_gib is None or plan.ds_config is None or not plan.num_params or not plan.resolved:
        return None
    ds = copy.deepcopy(plan.ds_config)
    zero = ds.setdefault("zero_optimization", {})
    zero["stage"] = 2
    zero.pop("offload_param", None)
    zero.update(_zero2_offload_buckets())  # ZeRO-3's "auto" buckets are sized for its modules, not ZeRO-2's reduction
    zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    ds["data_types"] = {"grad_accum_dtype": "fp32"}
    per_rank = plan.batch.micro * plan.batch.accumulation
    micro = _largest_fitting_micro(plan, ds, lambda m: per_rank % m == 0)[0]
    gpu = _phase_memory(plan, ds, micro).peak[1]
    if gpu > AUTO_MEMORY_SHARE * plan.gpu_memory_gib * GIB or _offloaded_host_bytes(plan, ds) > (plan.host_bytes or 0):
        return None
    return micro, gpu


def _plan_checkpoint_writes(plan: Plan) -> None:
    """--background_checkpoint copies each rank's share of a checkpoint to host memory: on when a node's copy, beside
    the optimizer states an offload keeps there, fits in 3/4 of the memory this node has available."""
    from . import ds_config as dsc

    if not plan.cfg.background_checkpoint:
        plan.checkpoint_writes = "synchronous (--no-background_checkpoint)"
        return
    offloaded = any(dsc.offloads(plan.ds_config))
    copy = plan.checkpoint_bytes * plan.ranks_per_node / plan.world
    need = copy * (2 if offloaded else 1)  # the offloaded states (~ the checkpoint's size) live in host memory too
    if not plan.here:  # a login node's memory says nothing of the GPU nodes'
        plan.checkpoint_writes = (f"in the background where a GPU node's host copy (~{copy / GIB:.1f} GiB"
                                  + (", beside the offloaded optimizer states" if offloaded else "")
                                  + ") fits in 3/4 of its free memory, else synchronous: decided when the run starts")
        return
    available = host_memory_available()
    if available is not None and need > 0.75 * available:
        plan.checkpoint_writes = (f"synchronous: the host copy (~{copy / GIB:.1f} GiB per node"
                                  + (", beside the offloaded optimizer states" if offloaded else "")
                                  + f") does not fit in 3/4 of the {available / GIB:.0f} GiB available")
        return
    plan.background_checkpoint = True
    plan.checkpoint_writes = (f"in the background, from a host copy of ~{copy / GIB:.1f} GiB per node"
                              + (f" ({available / GIB:.0f} GiB available)" if available is not None else ""))


def _find_resume_point(plan: Plan, move_incomplete: bool) -> None:
    """The checkpoint this run resumes from (None: a fresh start). Incomplete checkpoints in --checkpoint_dir never
    stop a start: a run moves them aside (a preflight says it will), then takes the newest complete one, or starts
    from step 0 with a warning. An unreadable directory or an explicit --resume_from_checkpoint that is not complete
    is a problem."""
    from pathlib import Path

    from .checkpoint import INCOMPLETE_DIR, ResumeError, find_resume_checkpoint, list_checkpoints, \
        move_incomplete_aside, resolve_explicit

    cfg = plan.cfg
    ckpt_dir = Path(cfg.checkpoint_dir)
    try:
        if move_incomplete:
            plan.incomplete_moved = move_incomplete_aside(ckpt_dir, plan.notes.append)
        else:
            for info in list_checkpoints(ckpt_dir):
                if not info.complete:
                    plan.notes.append(f"checkpoint: {info.path.name} is incomplete ({info.problem}): the run will "
                                      f"move it to {ckpt_dir / INCOMPLETE_DIR} and not resume from it")
        plan.resume = (resolve_explicit(Path(cfg.resume_from_checkpoint), plan.notes.append)
                       if cfg.resume_from_checkpoint else
                       find_resume_checkpoint(ckpt_dir, plan.notes.append) if cfg.resume == "auto"
                       else None)
    except (ResumeError, OSError) as e:  # an unreadable directory too: every rank waits for rank 0's verdict
        lines = str(e).splitlines()
        message = "\n      ".join(lines[:-1]) if len(lines) > 1 else lines[0]  # keep the list of damaged files
        plan.problems.append(Problem("--checkpoint_dir", cfg.checkpoint_dir, message,
                                     "remove the damaged checkpoints listed, or use another --checkpoint_dir"))
        return
    if plan.incomplete_moved and plan.resume is None and cfg.resume == "auto" and not cfg.resume_from_checkpoint:
        plan.notes.append(f"resume: NO complete checkpoint in {ckpt_dir}: {len(plan.incomplete_moved)} incomplete "
                          f"one(s) moved to {ckpt_dir / INCOMPLETE_DIR}; this run STARTS FROM STEP 0")


def _find_data_source(plan: Plan) -> None:
    """What --dataset means (files, a saved dataset, the hub, the embedded corpus); the data themselves are read by
    the preflight's sample check and the run's tokenization."""
    from .concat_dataset import DataError, resolve_source

    if plan.cfg.dummy_data or plan.tokenizer is None:
        return
    try:
        plan.data_source = resolve_source(plan.cfg)
    except DataError as e:
        plan.problems.append(e.problem)
