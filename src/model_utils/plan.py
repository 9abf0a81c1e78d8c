"""The plan of a run: configuration -> frozen results, each computed once by a plain function from the ones before.

    make_plan(cfg, world)
      hardware      where the plan is made and what it plans for (GPU memory, host memory, precision, fused loss)
      model         the tokenizer, the model's config, its size on the meta device, its FLOPs
      settings      the DeepSpeed config resolved but for the batch (flags applied, "auto" filled, precision)
      batch         stated by the flags and config (ds_config.BatchRequest), ZeRO-3's parameters whole or partitioned,
                    the micro-batch given or chosen by the memory model, the accumulation derived once; the DeepSpeed
                    config with it written
      memory        recomputed layers, the delayed update's prefetch, each phase's GPU memory, the host's share
      checkpoints   their size on disk and how they are written
      resume        the checkpoint to resume from (the deciding rank), incomplete ones moved aside
      data source   what --dataset means (the deciding rank)

What cannot be resolved is a Problem in `plan.problems`; nothing here builds the model or reads the data. The
preflight (`preflight.check_plan`) checks and prints a plan; the trainer (`trainer.build_run`) builds the run from it.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
from dataclasses import dataclass

from .config import REPO_ROOT, Problem, SpeedConfig, TrainConfig, validate_args
from .memory import AUTO_MEMORY_SHARE, GIB, PhaseMemory, choose_micro_batch, phase_memory


@dataclass(frozen=True)
class Hardware:
    """Where the plan is made, and the machines it plans for."""

    on_training_hardware: bool  # planned where the run trains (its own start, or a GPU node): this machine decides
    gpus: bool  # the run trains on GPUs: this machine's, or those of the nodes a login node plans for
    precision: str  # the best the training devices support: bf16, fp16 or fp32 (ds_config.hardware_precision)
    gpu_memory_gib: float | None  # one GPU's memory; None where no size is known
    gpu_memory_source: str  # the GPU's name, GPU_MEMORY_GIB, or why no size is known
    host_available: float | None  # this node's MemAvailable where the run starts; None on a login node
    ranks_per_node: int


@dataclass(frozen=True)
class ModelPlan:
    """The model as the run will build it, sized on the meta device."""

    tokenizer: object
    config: object  # transformers PretrainedConfig
    num_params: int
    param_groups: tuple[tuple[int, ...], ...]  # the optimizer's groups' parameter sizes (models.decay_groups)
    checkpointable_layers: int  # the layers transformers checkpoints one by one (models.checkpointable_layers)
    flops: object  # models.FlopsModel
    frozen_params: int = 0  # parameters that do not train (the model's own weights under LoRA), in num_params
    lora: object = None  # lora.LoraSettings; None: every weight trains
    adapters: object = None  # memory.AdapterActivations: LoRA's adapters per layer, as their activations scale
    largest_param: int = 0  # the largest parameter's elements (the embedding or the LM head, frozen ones included)

    @property
    def trainable_params(self) -> int:
        return self.num_params - self.frozen_params

    @property
    def layer_params(self) -> int:
        """One decoder layer's parameters (the non-embedding ones shared out over the layers)."""
        return self.flops.non_embedding_params // max(1, self.flops.num_layers)


@dataclass(frozen=True)
class MemoryModel:
    """Each phase's estimated GPU memory, and the host memory of offloaded states, for any DeepSpeed config and
    micro-batch of this model on this hardware: what the automatic micro-batch, the recomputed layers and the
    preflight's alternatives are chosen by."""

    model: ModelPlan
    hardware: Hardware
    world: int
    seq_len: int
    speed: SpeedConfig
    fused_loss: bool  # Liger's fused linear cross-entropy (the logits' memory depends on it)
    gradient_checkpointing: bool
    generation: bool  # the end-of-run sample loads the export beside the engine
    delayed_update_from_step: int
    batch: object  # ds_config.BatchRequest: the accumulation at each micro-batch

    def compiles(self, ds: dict) -> bool:
        """Whether the run compiles its decoder layers (speed.use_compile), on the GPUs it trains on."""
        from . import ds_config as dsc
        from .speed import use_compile, zero3_keeps_eager_layers

        eager = zero3_keeps_eager_layers(dsc.zero_stage(ds), any(dsc.offloads(ds)), self.model.lora is not None)
        return use_compile(self.hardware.gpus, eager, self.speed)

    def keeps_whole_parameters(self, ds: dict) -> bool:
        """Whether ZeRO-3 keeps every parameter whole on each GPU with `ds` (ds_config.keeps_whole_parameters)."""
        from . import ds_config as dsc

        return dsc.keeps_whole_parameters(ds, self.model.largest_param, self.model.num_params)

    def may_keep_whole_parameters(self, ds: dict) -> bool:
        """Where "auto" persistence may keep ZeRO-3's parameters whole: a GPU size to fit them in, ZeRO-3, nothing
        offloaded and no LoRA (whole parameters are measured and tested without either)."""
        from . import ds_config as dsc

        return (self.budget is not None and dsc.zero_stage(ds) == 3 and not any(dsc.offloads(ds))
                and self.model.lora is None and self.model.largest_param > 0)

    def prefetch_applies(self, ds: dict) -> bool:
        """Whether the delayed update can keep a second GPU copy of the 16-bit partition: ZeRO-1/2 with the optimizer
        offloaded to the CPU, --delayed_update_from_step, GPUs."""
        from . import ds_config as dsc

        return bool(self.delayed_update_from_step and dsc.cpu_optimizer_offload(ds) and dsc.zero_stage(ds) in (1, 2)
                    and self.hardware.gpus)

    def phases(self, ds: dict, micro: int, checkpointed_layers: int | None = None,
               prefetch: bool | None = None) -> PhaseMemory:
        """Each phase's estimated peak per GPU with `ds` and micro-batch `micro`; with --gradient_checkpointing,
        `checkpointed_layers` of the layers recompute (None: all of them); `prefetch`: the delayed update's second GPU
        buffer (None: where --delayed_update_prefetch is on, not auto, and applies)."""
        from . import ds_config as dsc

        if prefetch is None:
            prefetch = self.speed.delayed_update_prefetch == "on" and self.prefetch_applies(ds)
        off_opt, off_par = dsc.offloads(ds)
        return phase_memory(self.model.trainable_params, self.model.config, self.world, self.seq_len, micro,
                            dsc.zero_stage(ds), off_opt, off_par, dsc.precision(ds) != "fp32",
                            ds.get("zero_optimization", {}), self.gradient_checkpointing, self.fused_loss,
                            self.speed.flce_chunk_budget, self.generation,
                            fp32_grad_accumulation=dsc.fp32_grad_accumulation(ds), compiled=self.compiles(ds),
                            gpu_optimizer_share=self.gpu_optimizer_share(ds),
                            checkpointed_layers=checkpointed_layers, delayed_prefetch=prefetch,
                            accumulation=self.batch.accumulation_at(micro), frozen_params=self.model.frozen_params,
                            adapters=self.model.adapters, whole_params=self.keeps_whole_parameters(ds))

    def peak(self, ds: dict, micro: int, checkpointed_layers: int | None = None, prefetch: bool | None = None) -> float:
        return self.phases(ds, micro, checkpointed_layers, prefetch).peak[1]

    def gpu_optimizer_share(self, ds: dict) -> float:
        from . import ds_config as dsc

        return dsc.gpu_optimizer_share(ds, [list(g) for g in self.model.param_groups], self.world)

    def host_bytes(self, ds: dict) -> float:
        """Host memory a node needs for the states `ds` offloads (memory.offload_host_bytes)."""
        from . import ds_config as dsc
        from .memory import offload_host_bytes

        return offload_host_bytes(self.model.trainable_params, self.world, self.hardware.ranks_per_node,
                                  dsc.zero_stage(ds), *dsc.offloads(ds), dsc.fp32_grad_accumulation(ds),
                                  gpu=self.hardware.gpus, gpu_optimizer_share=self.gpu_optimizer_share(ds),
                                  pinned_optimizer=bool(dsc.offload_setting(ds, "offload_optimizer", "pin_memory")),
                                  frozen_params=self.model.frozen_params)

    def largest_fitting_micro(self, ds: dict, allowed) -> tuple[int, str]:
        """The automatic micro-batch (memory.choose_micro_batch) with `ds`; the default where no GPU size is known."""
        if self.hardware.gpu_memory_gib is None:
            return choose_micro_batch(self.seq_len, None, None, allowed)
        return choose_micro_batch(self.seq_len, self.hardware.gpu_memory_gib, lambda m: self.peak(ds, m), allowed)

    @property
    def budget(self) -> float | None:
        """The bytes of one GPU an automatic choice may fill (AUTO_MEMORY_SHARE); None where no size is known."""
        memory = self.hardware.gpu_memory_gib
        return None if memory is None else AUTO_MEMORY_SHARE * memory * GIB


@dataclass(frozen=True)
class MemoryEstimate:
    """The run's memory at the chosen settings."""

    phases: PhaseMemory  # each phase's peak per GPU
    checkpointed_layers: int | None  # decoder layers --gradient_checkpointing recomputes (None: it is off)
    checkpointed_layers_choice: str | None  # how --checkpointed_layers auto chose; None where it was given
    delayed_prefetch: bool  # the delayed update's second GPU buffer (--delayed_update_prefetch, resolved)
    delayed_prefetch_choice: str | None  # how --delayed_update_prefetch auto chose; None where it was not asked
    host_bytes: float  # host memory per node for the offloaded states (0 without offload)
    resume_host_bytes: float  # what a node needs beyond host_bytes while it loads a checkpoint


@dataclass(frozen=True)
class CheckpointWrites:
    """What a checkpoint weighs and how it is written."""

    bytes: float  # one checkpoint on disk (16-bit weights, fp32 master weights and Adam moments)
    background: bool  # --background_checkpoint, and this node's memory holds a host copy
    description: str  # how checkpoints are written, and why


@dataclass(frozen=True)
class Plan:
    """Everything a run is built from, resolved once. A field is None where an earlier one could not be resolved
    (its problem is in `problems`)."""

    cfg: TrainConfig
    world: int  # data-parallel ranks the run has (or will have: the launchers export WORLD_SIZE)
    hardware: Hardware
    fused_loss: bool
    seq_len: int
    raw_ds_config: dict | None = None  # the DeepSpeed config as written
    model: ModelPlan | None = None
    tokenizer: object = None  # also where the model could not be loaded
    ds_config: dict | None = None  # resolved: flags applied, the batch written, no "auto" left
    batch: object = None  # ds_config.Batch
    micro_batch_choice: str | None = None  # how "auto" chose the micro-batch; None where it was given
    parameters_choice: str | None = None  # how "auto" persistence chose whole or partitioned ZeRO-3 parameters
    memory_model: MemoryModel | None = None
    memory: MemoryEstimate | None = None
    compiled_layers: bool = False  # torch.compile'd decoder layers (they keep fewer activations); speed.use_compile
    checkpoints: CheckpointWrites | None = None
    resume: object = None  # checkpoint.CheckpointInfo to resume from; None: a fresh start (or not the deciding rank)
    incomplete_moved: tuple[str, ...] = ()  # incomplete checkpoints moved aside by this start
    data_source: object = None  # concat_dataset.DataSource; None for --dummy_data or on ranks that do not decide
    data_format: str | None = None  # sft_data.resolve_data_format: a fine-tuning format, or "pretraining"
    fine_tuning: object = None  # fine_tuning.FineTuningDefaults in cfg and ds_config; None: the config's own values
    problems: tuple[Problem, ...] = ()
    notes: tuple[str, ...] = ()


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
    from . import ds_config as dsc
    from .models import default_seq_len

    from .fine_tuning import apply_weight_decay, with_fine_tuning_defaults

    problems, notes = list(validate_args(cfg)), []
    fine_tuning = None
    if cfg.batch.num_epochs is None:  # with --num_epochs the trainer applies them once the data give the length
        cfg, fine_tuning = with_fine_tuning_defaults(cfg, cfg.batch.max_steps)
    hardware = probe_hardware(on_training_hardware, world)
    fused = fused_loss(cfg.speed, hardware)
    seq_len = cfg.model.seq_len or default_seq_len(cfg.model.model)
    plan = Plan(cfg, world, hardware, fused, seq_len, fine_tuning=fine_tuning)

    ds_path = cfg.optim.ds_config_path
    raw, found = dsc.load_json(ds_path) if ds_path.is_file() else (None, [])  # a missing file: validate_args
    problems += found
    tokenizer, model, found = load_model(cfg, seq_len)
    problems += found
    plan = dataclasses.replace(plan, raw_ds_config=raw, tokenizer=tokenizer, model=model)

    if raw is not None:
        if not hardware.on_training_hardware and raw.get("bf16", {}).get("enabled") is True:
            notes.append("bf16 is on: the GPU nodes must support it (A100/H100 or newer); not checkable here")
        plan, found, said = plan_batch(plan, raw)
        problems += found
        notes += said
        if plan.ds_config is not None:
            plan = dataclasses.replace(plan, ds_config=apply_weight_decay(copy.deepcopy(plan.ds_config), fine_tuning))
    if plan.ds_config is not None and model is not None:
        plan, found = plan_memory(plan)
        problems += found
    if decides:
        resume, moved, found, said = find_resume_point(cfg, move_incomplete)
        problems += found
        notes += said
        source, data_format, found = find_data_source(cfg, tokenizer)
        problems += found
        plan = dataclasses.replace(plan, resume=resume, incomplete_moved=tuple(moved), data_source=source,
                                   data_format=data_format)
    return dataclasses.replace(plan, problems=tuple(problems), notes=tuple(notes))


def probe_hardware(on_training_hardware: bool, world: int) -> Hardware:
    """This machine where the run trains on it; on a login node without GPUs, GPU nodes with bf16 (the run's own
    start checks its hardware)."""
    import torch

    from .distributed import bf16_supported
    from .ds_config import hardware_precision

    cuda = torch.cuda.is_available()
    here = cuda or on_training_hardware
    memory, source = gpu_memory_gib()
    return Hardware(on_training_hardware=here, gpus=cuda or not here,
                    precision=hardware_precision(cuda, bf16_supported()) if here else "bf16",
                    gpu_memory_gib=memory, gpu_memory_source=source,
                    host_available=host_memory_available() if here else None,
                    ranks_per_node=world if not cuda else min(world, torch.cuda.device_count()))


def fused_loss(speed: SpeedConfig, hardware: Hardware) -> bool:
    """Liger's fused loss: what this machine runs where the run starts; on a login node, what the GPU nodes run by
    default (the run's own start plans again with what they have)."""
    from .speed import use_fused_kernels

    if hardware.on_training_hardware:
        return use_fused_kernels(speed.fused_kernels, hardware.gpus)
    return speed.fused_kernels != "off"


def load_model(cfg: TrainConfig, seq_len: int) -> tuple[object, ModelPlan | None, list[Problem]]:
    """(tokenizer, the model sized on the meta device, problems)."""
    from .lora import LoraError, adapter_activations, meta_model, parameter_counts
    from .models import FlopsModel, checkpointable_layers, decay_groups, model_config, preset_names, tokenizer_source
    from .tokenizer import load_tokenizer

    try:
        tokenizer = load_tokenizer(tokenizer_source(cfg.model.tokenizer, cfg.model.model))
    except (OSError, ValueError) as e:
        return None, None, [Problem("--tokenizer", cfg.model.tokenizer or cfg.model.model,
                                    f"could not be loaded: {e}".split("\n")[0],
                                    "pass a local tokenizer directory or a hub id reachable from here")]
    try:
        config = model_config(cfg.model.model, tokenizer, cfg.model.attention_dropout)
    except (OSError, ValueError) as e:
        return tokenizer, None, [Problem("--model", cfg.model.model, f"could not be loaded: {e}".split("\n")[0],
                                         f"use a preset ({preset_names()}), a model "
                                         "directory with config.json, or a reachable hub id")]
    settings = cfg.model.lora_settings()
    try:  # the adapters are sized on the meta device too: trainable vs frozen for the memory
        sized = meta_model(config, settings)
    except LoraError as e:
        return tokenizer, None, e.problems
    counts = parameter_counts(sized)
    num_params = counts.trainable + counts.frozen
    base_params = counts.frozen if settings is not None else num_params  # LoRA freezes every weight of the model
    frozen = counts.frozen if settings is not None else 0
    layers = len(checkpointable_layers(sized))
    # FLOPs: the base model's 6N per token (model FLOPs; LoRA skips the weights' gradients, not the rest).
    model = ModelPlan(tokenizer, config, num_params,
                      param_groups=tuple(tuple(p.numel() for p in group)
                                         for group in decay_groups(sized.parameters())),
                      checkpointable_layers=layers, flops=FlopsModel.from_config(config, base_params, seq_len),
                      frozen_params=frozen, lora=settings,
                      adapters=adapter_activations(sized, settings, layers) if settings is not None else None,
                      largest_param=max(p.numel() for p in sized.parameters()))
    return tokenizer, model, []


def plan_batch(plan: Plan, raw: dict) -> tuple[Plan, list[Problem], list[str]]:
    """The DeepSpeed config and the batch: the settings resolved, the micro-batch given or the largest the memory
    model fits, the accumulation derived from the global batch (ds_config.BatchRequest holds the rule)."""
    from . import ds_config as dsc

    cfg, model = plan.cfg, plan.model
    ds, notes, problems = dsc.resolve_settings(raw, cfg, plan.hardware.precision,
                                               model.config.hidden_size if model else None)
    if plan.fine_tuning is not None:  # its own line states the values it gave the unset flags: they override nothing
        notes = [note for note in notes if not note.startswith(tuple(f"--{flag} " for flag in plan.fine_tuning.filled))]
    request, said, found = dsc.BatchRequest.of(raw, cfg.batch, plan.world, plan.seq_len)
    notes += said
    problems += found
    if request is None:
        return plan, problems, notes
    memory_model = None if model is None else MemoryModel(
        model, plan.hardware, plan.world, plan.seq_len, cfg.speed, plan.fused_loss, cfg.model.gradient_checkpointing,
        bool(cfg.logging.generate_prompt and cfg.checkpoint.export), cfg.optim.delayed_update_from_step, request)
    choice = parameters = None
    micro = request.micro
    if memory_model is not None:
        ds, parameters = choose_whole_parameters(memory_model, ds, raw, micro, request.divides)
    if micro is None:
        if memory_model is not None:
            micro, choice = memory_model.largest_fitting_micro(ds, request.divides)
        else:
            micro, choice = choose_micro_batch(plan.seq_len, None, None, request.divides)
    batch, said, found = dsc.settle_batch(request, micro, plan.seq_len)
    notes += said
    problems += found
    if batch is None:
        return dataclasses.replace(plan, memory_model=memory_model, parameters_choice=parameters), problems, notes
    ds, notes, problems = dsc.with_batch(ds, batch, notes, problems)
    compiled = memory_model.compiles(ds) if memory_model else False
    if compiled and dsc.zero_stage(ds) == 3:
        ds = dsc.with_layer_prefetch(ds, raw, model.layer_params)
    return (dataclasses.replace(plan, ds_config=ds, batch=batch, micro_batch_choice=choice, memory_model=memory_model,
                                compiled_layers=compiled, parameters_choice=parameters),
            problems, notes)


def plan_memory(plan: Plan) -> tuple[Plan, list[Problem]]:
    """The recomputed layers, the prefetch, each phase's memory, the host's share, and the checkpoints' writes."""
    from . import ds_config as dsc
    from .memory import resume_host_bytes

    memory_model, ds, batch, model = plan.memory_model, plan.ds_config, plan.batch, plan.model
    layers, layers_choice, problems = choose_checkpointed_layers(plan.cfg, memory_model, ds, batch.micro)
    prefetch, prefetch_choice = choose_prefetch(plan.cfg.speed, memory_model, ds, batch.micro, layers)
    memory = MemoryEstimate(
        phases=memory_model.phases(ds, batch.micro, layers, prefetch),
        checkpointed_layers=layers, checkpointed_layers_choice=layers_choice,
        delayed_prefetch=prefetch, delayed_prefetch_choice=prefetch_choice,
        host_bytes=memory_model.host_bytes(ds),
        resume_host_bytes=resume_host_bytes(model.trainable_params, plan.world, plan.hardware.ranks_per_node,
                                            dsc.offloads(ds)[0], memory_model.gpu_optimizer_share(ds)))
    bf16 = dsc.precision(ds) != "fp32"  # 16-bit weights and gradients: bf16 or fp16, the same sizes
    checkpoint_bytes = model.trainable_params * (2 + 12 if bf16 else 4 + 8) * 1.05  # LoRA: no frozen weight
    writes = plan_checkpoint_writes(plan.cfg.checkpoint.background_checkpoint, checkpoint_bytes,
                                    any(dsc.offloads(ds)), plan.hardware, plan.world)
    return dataclasses.replace(plan, memory=memory, checkpoints=writes), problems


# The automatic choice keeps ZeRO-3's parameters whole where that costs at most half the micro-batch: on 4 GPUs of one
# host whole parameters at half the micro-batch ran as fast as partitioned ones at the full one (docs/PERFORMANCE.md).
WHOLE_PARAMETERS_MICRO_SHARE = 0.5


def choose_whole_parameters(memory_model: MemoryModel, ds: dict, raw: dict, micro: int | None,
                            allowed) -> tuple[dict, str | None]:
    """ZeRO-3's `"stage3_param_persistence_threshold": "auto"` resolved, before the micro-batch: every parameter
    persistent (ds_config.keeps_whole_parameters: nothing gathered per micro-batch) where the estimate with whole
    parameters fits AUTO_MEMORY_SHARE of the GPU at the given micro-batch, or, for an automatic one, at no less than
    WHOLE_PARAMETERS_MICRO_SHARE of the micro-batch partitioned parameters would allow. Otherwise, where
    MemoryModel.may_keep_whole_parameters rules them out or the config sets a number, `ds` as resolve_settings left it
    (Hugging Face's 10 x hidden). Returns (the config, the header's line saying which and why; None where "auto"
    decided nothing)."""
    from . import ds_config as dsc

    if not (memory_model.may_keep_whole_parameters(ds) and dsc.persistence_is_auto(raw)):
        return ds, None
    budget = memory_model.budget
    whole = dsc.with_whole_parameters(ds, memory_model.model.largest_param)
    if micro is None:
        micro = memory_model.largest_fitting_micro(whole, allowed)[0]
        partitioned = memory_model.largest_fitting_micro(ds, allowed)[0]
        enough = micro >= WHOLE_PARAMETERS_MICRO_SHARE * partitioned
        shortfall = f"micro-batch {micro} against {partitioned} with them partitioned"
    else:
        enough, shortfall = True, ""
    need = memory_model.peak(whole, micro)
    where = f"~{need / GIB:.1f} GiB at micro-batch {micro}, {AUTO_MEMORY_SHARE:.0%} of the GPU is {budget / GIB:.1f}"
    if need <= budget and enough:
        largest = memory_model.model.largest_param
        return whole, (f"ZeRO-3 keeps every parameter whole on each GPU (\"stage3_param_persistence_threshold\": "
                       f"\"auto\" -> {largest:,} elements, the largest parameter; {where}): no layer is gathered "
                       "for its forward or backward")
    why = shortfall if need <= budget else where
    return ds, (f"ZeRO-3 partitions the parameters (\"stage3_param_persistence_threshold\": \"auto\" -> "
                f"{ds['zero_optimization']['stage3_param_persistence_threshold']:,}): whole ones would take {why}")


def choose_prefetch(speed: SpeedConfig, memory_model: MemoryModel, ds: dict, micro: int,
                    layers: int | None) -> tuple[bool, str | None]:
    """--delayed_update_prefetch resolved, after the micro-batch and the recomputed layers. auto: on where the run's
    estimated peak with the second buffer still fits AUTO_MEMORY_SHARE of the GPU (or no GPU size is known), so that
    it never takes a larger micro-batch's or a kept layer's place."""
    setting = speed.delayed_update_prefetch
    if setting == "off" or not memory_model.prefetch_applies(ds):
        return False, None
    if setting == "on":
        return True, None
    budget = memory_model.budget
    if budget is None:
        return True, f"auto: on ({memory_model.hardware.gpu_memory_source}: no GPU size to fill)"
    need = memory_model.peak(ds, micro, layers, prefetch=True)
    on = need <= budget
    return on, (f"auto: {'on' if on else 'off'}, ~{need / GIB:.1f} GiB with it, {AUTO_MEMORY_SHARE:.0%} of the GPU is "
                f"{budget / GIB:.1f}")


def choose_checkpointed_layers(cfg: TrainConfig, memory_model: MemoryModel, ds: dict,
                               micro: int) -> tuple[int | None, str | None, list[Problem]]:
    """--checkpointed_layers resolved to a count: (count, how auto chose, problems). auto: the fewest recomputed
    layers with which the run's estimated peak fits AUTO_MEMORY_SHARE of the GPU at the micro-batch chosen with all
    of them recomputed (so "auto" micro-batch and layers together never pick a smaller micro-batch than all layers
    would); all where no GPU size is known."""
    if not cfg.model.gradient_checkpointing:
        return None, None, []
    layers, problems = memory_model.model.config.num_hidden_layers, []
    wanted, checkpointable = cfg.model.checkpointed_layers, memory_model.model.checkpointable_layers
    if wanted != "all" and checkpointable != layers:
        problems.append(Problem("--checkpointed_layers", wanted,
                                f"needs layers transformers checkpoints one by one: {cfg.model.model} has "
                                f"{checkpointable} of its {layers}",
                                "leave --checkpointed_layers at all (every layer recomputes)"))
        wanted = "all"
    if isinstance(wanted, int):
        if wanted > layers:
            problems.append(Problem("--checkpointed_layers", wanted, f"exceeds the {layers} decoder layers of "
                                    f"{cfg.model.model}", f"pass at most {layers}, or all"))
        return min(wanted, layers), None, problems
    if wanted == "all":
        return layers, None, problems
    budget = memory_model.budget
    if budget is None:
        return layers, f"auto: all ({memory_model.hardware.gpu_memory_source}: no GPU size to fill)", problems
    for count in range(layers + 1):
        peak = memory_model.peak(ds, micro, count)
        if peak <= budget:
            return count, (f"auto: the fewest with which the run fits {AUTO_MEMORY_SHARE:.0%} of the GPU by the "
                           f"estimate (~{peak / GIB:.1f} GiB of {memory_model.hardware.gpu_memory_gib:.1f})"), problems
    return layers, f"auto: all (fewer do not fit {AUTO_MEMORY_SHARE:.0%} of the GPU)", problems


def plan_checkpoint_writes(background: bool, checkpoint_bytes: float, offloaded: bool, hardware: Hardware,
                           world: int) -> CheckpointWrites:
    """--background_checkpoint copies each rank's share of a checkpoint to host memory: on when a node's copy, beside
    the optimizer states an offload keeps there, fits in 3/4 of the memory this node has available."""
    if not background:
        return CheckpointWrites(checkpoint_bytes, False, "synchronous (--no-background_checkpoint)")
    copy_bytes = checkpoint_bytes * hardware.ranks_per_node / world
    need = copy_bytes * (2 if offloaded else 1)  # the offloaded states (~ the checkpoint's size) live in host memory
    beside = ", beside the offloaded optimizer states" if offloaded else ""
    if not hardware.on_training_hardware:  # a login node's memory says nothing of the GPU nodes'
        return CheckpointWrites(checkpoint_bytes, False,
                                f"in the background where a GPU node's host copy (~{copy_bytes / GIB:.1f} GiB{beside}) "
                                "fits in 3/4 of its free memory, else synchronous: decided when the run starts")
    available = hardware.host_available
    if available is not None and need > 0.75 * available:
        return CheckpointWrites(checkpoint_bytes, False,
                                f"synchronous: the host copy (~{copy_bytes / GIB:.1f} GiB per node{beside}) does not "
                                f"fit in 3/4 of the {available / GIB:.0f} GiB available")
    return CheckpointWrites(checkpoint_bytes, True,
                            f"in the background, from a host copy of ~{copy_bytes / GIB:.1f} GiB per node"
                            + (f" ({available / GIB:.0f} GiB available)" if available is not None else ""))


def find_resume_point(cfg: TrainConfig, move_incomplete: bool) -> tuple[object, list[str], list[Problem], list[str]]:
    """(the checkpoint to resume from or None, incomplete ones moved aside, problems, notes). Incomplete checkpoints
    never stop a start: a run moves them aside (a preflight says it will), then takes the newest complete one, or
    starts from step 0 with a warning. An unreadable directory or an explicit --resume_from_checkpoint that is not
    complete is a problem."""
    from pathlib import Path

    from .checkpoint import ResumeError, find_resume_checkpoint, list_checkpoints, move_incomplete_aside, \
        resolve_explicit
    from .run_dir import RunDir

    ckpt = cfg.checkpoint
    run_dir = RunDir.of(ckpt.checkpoint_dir)
    notes: list[str] = []
    moved: list[str] = []
    try:
        if move_incomplete:
            moved = move_incomplete_aside(run_dir.root, notes.append)
        else:
            for info in list_checkpoints(run_dir.root):
                if not info.complete:
                    notes.append(f"checkpoint: {info.path.name} is incomplete ({info.problem}): the run will "
                                 f"move it to {run_dir.incomplete} and not resume from it")
        resume = (resolve_explicit(Path(ckpt.resume_from_checkpoint), notes.append) if ckpt.resume_from_checkpoint
                  else find_resume_checkpoint(run_dir.root, notes.append) if ckpt.resume == "auto"
                  else None)
    except (ResumeError, OSError) as e:  # an unreadable directory too: every rank waits for rank 0's verdict
        lines = str(e).splitlines()
        message = "\n      ".join(lines[:-1]) if len(lines) > 1 else lines[0]  # keep the list of damaged files
        return None, moved, [Problem("--checkpoint_dir", ckpt.checkpoint_dir, message,
                                     "remove the damaged checkpoints listed, or use another --checkpoint_dir")], notes
    if moved and resume is None and ckpt.resume == "auto" and not ckpt.resume_from_checkpoint:
        notes.append(f"resume: NO complete checkpoint in {run_dir.root}: {len(moved)} incomplete one(s) moved to "
                     f"{run_dir.incomplete}; this run STARTS FROM STEP 0")
    return resume, moved, [], notes


def find_data_source(cfg: TrainConfig, tokenizer) -> tuple[object, str | None, list[Problem]]:
    """What --dataset means (files, a saved dataset, the hub, the embedded corpus) and what its rows hold (a
    fine-tuning format or pretraining text, from --data_format and the columns); the data themselves are read by the
    preflight's sample check and the run's tokenization."""
    from .concat_dataset import DataError, resolve_source
    from .sft_data import resolve_data_format

    if cfg.data.dummy_data or tokenizer is None:
        return None, None, []
    try:
        source = resolve_source(cfg.data)
        return source, resolve_data_format(cfg.data, source), []
    except DataError as e:
        return None, None, [e.problem]


# ----------------------------------------------------------------------------------------------------------------------
# Alternatives the preflight proposes (what-ifs on a plan; none changes the user's config)
# ----------------------------------------------------------------------------------------------------------------------
def automatic_micro_batch(plan: Plan) -> int | None:
    """The micro-batch "auto" would take for this plan's config and per-rank batch (the largest that divides it and
    fits by the estimate); None where no GPU size or model is known."""
    if plan.memory_model is None or plan.memory_model.budget is None or plan.batch is None:
        return None
    per_rank = plan.batch.micro * plan.batch.accumulation
    return plan.memory_model.largest_fitting_micro(plan.ds_config, lambda m: per_rank % m == 0)[0]


# The share of a node's available memory a proposed offload may plan to fill: the model of the offloaded states came
# within 2% of the measured peaks (docs/PERFORMANCE.md), and the node's other processes and page cache need the rest.
HOST_MEMORY_SHARE = 0.9


def partial_offload_that_fits(plan: Plan, host_available: float) -> tuple[float, str, float, float] | None:
    """For offloaded states that do not fit the node: a ZeRO-3 run with part of its optimizer offloaded, the largest
    `offload_optimizer.ratio` (steps of 0.05) whose host memory fits HOST_MEMORY_SHARE of `host_available` and whose
    GPU part fits AUTO_MEMORY_SHARE of the GPU at micro-batch 1. The parameters stay on the GPU where they fit there
    (offload_param none: each micro-batch would otherwise fetch all of them from host memory twice), and are offloaded
    otherwise. Returns (ratio, offload_param device, host bytes, GPU bytes), or None."""
    memory_model = plan.memory_model
    if memory_model is None or memory_model.budget is None or plan.ds_config is None:
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
            host = memory_model.host_bytes(ds)
            if host > HOST_MEMORY_SHARE * host_available:
                continue
            gpu = memory_model.peak(ds, 1)
            if gpu <= memory_model.budget:
                return offload["ratio"], param_device, host, gpu
            break  # a smaller ratio keeps more of the optimizer on the GPU
    return None


def checkpointed_micro_that_fits(plan: Plan) -> tuple[int, float] | None:
    """For a run without activation checkpointing: the automatic micro-batch of the same config and per-rank batch with
    --gradient_checkpointing, and its GPU bytes, where that micro-batch is larger than this run's (under ZeRO-3 with
    the parameters offloaded it fetches them fewer times per step); else None."""
    if plan.cfg.model.gradient_checkpointing or plan.memory_model is None:
        return None
    checkpointed = dataclasses.replace(plan, memory_model=dataclasses.replace(plan.memory_model,
                                                                              gradient_checkpointing=True))
    micro = automatic_micro_batch(checkpointed)
    if micro is None or micro <= plan.batch.micro:  # None: no GPU size known; a micro-batch of 1 where none fits
        return None
    return micro, checkpointed.memory_model.peak(plan.ds_config, micro)


def _as_zero2(ds: dict, config: str) -> dict:
    """`ds` as ZeRO-2 (a copy): ZeRO-3's settings and parameter offload dropped, the gradient buckets of the
    repository's ZeRO-2 `config` (ZeRO-3's "auto" buckets are sized for its modules, not ZeRO-2's reduction; none
    where the repository's configs are not at hand)."""
    ds = copy.deepcopy(ds)
    zero = {key: value for key, value in ds.get("zero_optimization", {}).items()
            if not key.startswith("stage3_") and key != "offload_param"}
    path = REPO_ROOT / config
    if path.is_file():
        written = json.loads(path.read_text()).get("zero_optimization", {})
        zero.update({key: written[key] for key in ("reduce_bucket_size", "overlap_comm", "contiguous_gradients")
                     if key in written})
    ds["zero_optimization"] = dict(zero, stage=2)
    return ds


def zero2_that_fits(plan: Plan) -> float | None:
    """For ZeRO-3 without offload: the same config as ZeRO-2 (ds_config.json's gradient buckets), which keeps whole
    parameters on every GPU. Returns its GPU bytes where it fits the GPU at this run's micro-batch, else None."""
    from . import ds_config as dsc

    memory_model = plan.memory_model
    if (memory_model is None or memory_model.budget is None or plan.ds_config is None or plan.batch is None
            or dsc.zero_stage(plan.ds_config) != 3 or any(dsc.offloads(plan.ds_config))):
        return None
    ds = _as_zero2(plan.ds_config, "ds_config.json")
    gpu = memory_model.peak(ds, plan.batch.micro)
    return gpu if gpu <= memory_model.budget else None


def whole_parameters_that_fit(plan: Plan) -> float | None:
    """For a run whose ZeRO-3 parameters are partitioned where "auto" persistence could keep them whole
    (MemoryModel.may_keep_whole_parameters): the same config with every parameter whole on each GPU. Returns its GPU
    bytes where it fits the GPU at this run's micro-batch, else None."""
    from . import ds_config as dsc

    memory_model = plan.memory_model
    if (memory_model is None or plan.ds_config is None or plan.batch is None
            or not memory_model.may_keep_whole_parameters(plan.ds_config)
            or memory_model.keeps_whole_parameters(plan.ds_config)):
        return None
    gpu = memory_model.peak(dsc.with_whole_parameters(plan.ds_config, plan.model.largest_param), plan.batch.micro)
    return gpu if gpu <= memory_model.budget else None


def zero2_offload_that_fits(plan: Plan) -> tuple[int, float] | None:
    """For ZeRO-3 with the parameters offloaded: configs/zero2-offload.json's setup (ZeRO-2, the whole optimizer
    offloaded, fp32 gradient accumulation on the GPU) at this world and per-rank batch, which keeps the parameters on
    every GPU and so fetches none from host memory. Returns (its automatic micro-batch, its GPU bytes) where that fits
    the GPU and its host part no more than this config's, else None."""
    memory_model = plan.memory_model
    if memory_model is None or memory_model.budget is None or plan.ds_config is None or plan.memory is None:
        return None
    ds = _as_zero2(plan.ds_config, "configs/zero2-offload.json")
    ds["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    ds["data_types"] = {"grad_accum_dtype": "fp32"}
    per_rank = plan.batch.micro * plan.batch.accumulation
    micro = memory_model.largest_fitting_micro(ds, lambda m: per_rank % m == 0)[0]
    gpu = memory_model.peak(ds, micro)
    if gpu > memory_model.budget or memory_model.host_bytes(ds) > (plan.memory.host_bytes or 0):
        return None
    return micro, gpu
