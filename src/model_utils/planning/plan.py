"""The plan of a run: configuration -> frozen results, each computed once by a plain function from the ones before.

    make_plan(cfg, world)
      hardware      where the plan is made and what it plans for (GPU memory, host memory, precision, fused loss)
      model         the tokenizer, the model's config, its size on the meta device, its FLOPs
      settings      the DeepSpeed config resolved but for the batch (flags applied, "auto" filled, precision)
      batch         stated by the flags and config (config.batch.BatchRequest), ZeRO-3's parameters whole or
                    partitioned, the micro-batch given or chosen by the memory model, the accumulation derived once; the DeepSpeed
                    config with it written
      memory        recomputed layers, the delayed update's prefetch, each phase's GPU memory, the host's share
      checkpoints   their size on disk and how they are written
      resume        the checkpoint to resume from (the deciding rank), incomplete ones moved aside
      data source   what --dataset means (the deciding rank)

What cannot be resolved is a Problem in `plan.problems`; nothing here builds the model or reads the data. The
preflight (`planning.preflight.check_plan`) checks and prints a plan; `train.build.build_run` builds the run from it.
The memory model and the choices it makes live in memory_model.py.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

from model_utils.checkpoint.protocol import (ResumeError, find_resume_checkpoint, list_checkpoints,
                                             move_incomplete_aside, resolve_explicit)
from model_utils.config import deepspeed as dsc
from model_utils.config.batch import BatchRequest, settle_batch, with_batch
from model_utils.config.checks import validate_args
from model_utils.config.deepspeed import hardware_precision
from model_utils.config.fine_tuning import apply_weight_decay, with_fine_tuning_defaults
from model_utils.config.preference import OFF, pair_block_len
from model_utils.config.presets import default_seq_len, preset_names
from model_utils.config.settings import SpeedConfig, TrainConfig
from model_utils.core.problems import Problem
from model_utils.core.run_dir import RunDir
from model_utils.data.errors import DataError
from model_utils.data.preference.formats import resolve_run_format
from model_utils.data.sources import resolve_source
from model_utils.data.tokenizer import load_tokenizer
from model_utils.models.build import (FlopsModel, checkpointable_layers, decay_groups, model_config, rope_problem,
                                      scale_rope, tokenizer_source)
from model_utils.models.lora import LoraError, adapter_activations, meta_model, parameter_counts
from model_utils.models.memory import (GIB, PhaseMemory, QuantizedBase, choose_micro_batch,
                                       offloaded_activation_bytes, resume_host_bytes)
from model_utils.models.quantization import quantized_sizes
from model_utils.models.sequence_parallel import sequence_parallel_problems
from model_utils.models.speed import liger_kernels_in_force, use_fused_kernels
from model_utils.models.vision.build import is_vision_model
from model_utils.planning.memory_model import (Hardware, MemoryModel, ModelPlan, choose_checkpointed_layers,
                                               choose_prefetch, choose_whole_parameters)
from model_utils.core.user_code import is_user_function
from model_utils.planning.custom import custom_memory, custom_peak_bytes, custom_problems, load_custom_model
from model_utils.planning.vision import load_vision_model, vision_data_format, vision_defaults


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
    activation_host_bytes: float = 0.0  # host memory per node for the layers' inputs --offload_activations moves
    tiled_mlp: bool = False  # --tiled_mlp resolved (MemoryModel.tiles_mlp): the decoder layers' MLPs run in tiles


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
    world: int  # data-parallel ranks the run has (or will have: the launchers export WORLD_SIZE), GPUs / N
    hardware: Hardware
    fused_loss: bool
    seq_len: int
    raw_ds_config: dict | None = None  # the DeepSpeed config as written
    model: ModelPlan | None = None
    tokenizer: object = None  # also where the model could not be loaded
    ds_config: dict | None = None  # resolved: flags applied, the batch written, no "auto" left
    batch: object = None  # config.batch.Batch
    micro_batch_choice: str | None = None  # how "auto" chose the micro-batch; None where it was given
    parameters_choice: str | None = None  # how "auto" persistence chose whole or partitioned ZeRO-3 parameters
    memory_model: MemoryModel | None = None
    memory: MemoryEstimate | None = None
    compiled_layers: bool = False  # compiled decoder layers (fewer activations kept): models.speed.use_compile
    checkpoints: CheckpointWrites | None = None
    resume: object = None  # checkpoint.protocol.CheckpointInfo to resume from; None: fresh (or not the deciding rank)
    incomplete_moved: tuple[str, ...] = ()  # incomplete checkpoints moved aside by this start
    data_source: object = None  # data.sources.DataSource; None for --dummy_data or on ranks that do not decide
    data_format: str | None = None  # data.sft.formats.resolve_data_format: a fine-tuning format, or "pretraining"
    fine_tuning: object = None  # config.fine_tuning.FineTuningDefaults in cfg and ds_config; None: the config's own
    problems: tuple[Problem, ...] = ()
    notes: tuple[str, ...] = ()

    @property
    def sequence_parallel(self) -> int:
        return self.cfg.model.sequence_parallel

    @property
    def ranks(self) -> int:
        """The GPUs: data-parallel ranks x the GPUs that share each sequence (ZeRO partitions over all of them)."""
        return self.world * self.sequence_parallel

    @property
    def torch_final_norm(self) -> bool:
        """Whether PyTorch's own RMSNorm runs the model's final norm (not Liger's): what --offload_activations moves to
        the host depends on it (models.memory.offloaded_activation_bytes)."""
        return not (self.fused_loss
                    and liger_kernels_in_force(self.cfg.speed.liger_kernels, self.compiled_layers) == "all")

    def offloaded_bytes(self, rank_tokens: int, micro: int, recomputed_layers: int) -> float:
        """One rank's host memory for --offload_activations with `rank_tokens` tokens of each sequence and
        `recomputed_layers` layers recomputing (models.memory.offloaded_activation_bytes with this plan's model,
        precision, final norm and loss)."""
        return offloaded_activation_bytes(self.model.config, rank_tokens, micro, recomputed_layers,
                                          dsc.precision(self.ds_config) != "fp32", self.torch_final_norm,
                                          self.fused_loss)

    @property
    def sequence_tokens(self) -> int:
        """The most tokens one sequence holds, the positions it counts up to: --seq_len (a block, or one sequence of
        a preference pair, whose block holds two)."""
        return self.cfg.model.seq_len or default_seq_len(self.cfg.model.model)

    @property
    def rank_seq_len(self) -> int:
        """The tokens of each sequence that one GPU holds (--seq_len / --sequence_parallel)."""
        return self.seq_len // self.sequence_parallel


def gpu_memory_gib() -> tuple[float | None, str]:
    """This machine's GPU memory, or GPU_MEMORY_GIB: on a login node, the GPU nodes' size; beside a larger GPU, the
    size the run plans for and holds itself to (runtime.distributed.cap_gpu_memory: a larger GPU standing in for a
    smaller one, or a GPU shared)."""
    import torch

    from model_utils.runtime.distributed import gpu_memory_override

    override = gpu_memory_override()
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        total = props.total_memory / GIB
        if override is not None and override < total:
            return override, f"GPU_MEMORY_GIB, of the {props.name}'s {total:.1f}"
        return total, props.name
    return (override, "GPU_MEMORY_GIB") if override is not None else (None, "no GPU visible here")


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
    problems, notes = list(validate_args(cfg)), []
    cfg = vision_defaults(cfg)
    fine_tuning = None
    if cfg.batch.num_epochs is None:  # with --num_epochs the trainer applies them once the data give the length
        cfg, fine_tuning = with_fine_tuning_defaults(cfg, cfg.batch.max_steps)
    hardware = probe_hardware(on_training_hardware, world)
    fused = fused_loss(cfg.speed, hardware)
    seq_len = cfg.model.seq_len or default_seq_len(cfg.model.model)
    if is_user_function(cfg.data.dataset):  # an item counts as --seq_len positions in the throughput, 1 if unset
        seq_len = cfg.model.seq_len or 1
    if cfg.preference.preference != OFF:  # --seq_len bounds each sequence of a pair; a block holds a pair whole
        seq_len = pair_block_len(seq_len)
    plan = Plan(cfg, max(world // cfg.model.sequence_parallel, 1), hardware, fused, seq_len, fine_tuning=fine_tuning)

    ds_path = cfg.optim.ds_config_path
    raw, found = dsc.load_json(ds_path) if ds_path.is_file() else (None, [])  # a missing file: validate_args
    problems += found
    tokenizer, model, found = load_model(cfg, seq_len)
    problems += found
    if model is not None and model.custom is None:
        problems += sequence_parallel_problems(model.config, cfg.model.sequence_parallel, seq_len, world,
                                               cfg.model.attn_implementation)
    plan = dataclasses.replace(plan, raw_ds_config=raw, tokenizer=tokenizer, model=model)

    if raw is not None:
        if not hardware.on_training_hardware and raw.get("bf16", {}).get("enabled") is True:
            notes.append("bf16 is on: the GPU nodes must support it (compute capability 8.0, Ampere, or newer); not checkable here")
        plan, found, said = plan_batch(plan, raw)
        problems += found
        notes += said
        if plan.ds_config is not None:
            plan = dataclasses.replace(plan, ds_config=apply_weight_decay(copy.deepcopy(plan.ds_config), fine_tuning))
    if plan.ds_config is not None and model is not None and model.custom is not None:
        train = custom_memory(plan)
        writes = plan_checkpoint_writes(cfg.checkpoint.background_checkpoint, checkpoint_bytes(plan),
                                        any(dsc.offloads(plan.ds_config)), plan.hardware, plan.ranks)
        memory = MemoryEstimate(PhaseMemory(train, train, 0.0, 0.0), None, None, False, None, 0.0, 0.0)
        plan = dataclasses.replace(plan, memory=memory, checkpoints=writes)
    elif plan.ds_config is not None and model is not None:
        plan, found = plan_memory(plan)
        problems += found
    if decides:
        resume, moved, found, said = find_resume_point(cfg, move_incomplete)
        problems += found
        notes += said
        source, data_format, found = find_data_source(cfg, tokenizer, model is not None and model.vision is not None)
        problems += found
        plan = dataclasses.replace(plan, resume=resume, incomplete_moved=tuple(moved), data_source=source,
                                   data_format=data_format)
    return dataclasses.replace(plan, problems=tuple(problems), notes=tuple(notes))


def probe_hardware(on_training_hardware: bool, world: int) -> Hardware:
    """This machine where the run trains on it; on a login node without GPUs, GPU nodes with bf16 (the run's own
    start checks its hardware)."""
    import torch

    from model_utils.runtime.distributed import bf16_supported

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
    if hardware.on_training_hardware:
        return use_fused_kernels(speed.fused_kernels, hardware.gpus)
    return speed.fused_kernels != "off"


def load_model(cfg: TrainConfig, seq_len: int) -> tuple[object, ModelPlan | None, list[Problem]]:
    """(tokenizer, the model sized on the meta device, problems); a vision-language model's by planning.vision, a
    model of your own's by planning.custom."""
    if is_user_function(cfg.model.model):
        tokenizer, model, problems = load_custom_model(cfg)
        return tokenizer, model, problems + custom_problems(cfg)
    if is_vision_model(cfg.model.model):
        return load_vision_model(cfg, seq_len)
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
    if cfg.model.rope_scaling:
        if problem := rope_problem(config, cfg.model.rope_scaling):
            return tokenizer, None, [problem]
        scale_rope(config, cfg.model.rope_scaling)
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
                      largest_param=max(p.numel() for p in sized.parameters()),
                      quantized=QuantizedBase(*quantized_sizes(sized)) if settings and settings.load_in_4bit else None)
    return tokenizer, model, []


def plan_batch(plan: Plan, raw: dict) -> tuple[Plan, list[Problem], list[str]]:
    """The DeepSpeed config and the batch: the settings resolved, the micro-batch given or the largest the memory
    model fits, the accumulation derived from the global batch (config.batch.BatchRequest holds the rule)."""
    cfg, model = plan.cfg, plan.model
    ds, notes, problems = dsc.resolve_settings(raw, cfg, plan.hardware.precision,
                                               hidden_size(model))
    if plan.fine_tuning is not None:  # its own line states the values it gave the unset flags: they override nothing
        notes = [note for note in notes if not note.startswith(tuple(f"--{flag} " for flag in plan.fine_tuning.filled))]
    request, said, found = BatchRequest.of(raw, cfg.batch, plan.world, plan.seq_len)
    notes += said
    problems += found
    if request is None:
        return plan, problems, notes
    # preference tuning's log-probabilities hold a chunk of logits at a time, as the fused loss does
    no_logits = plan.fused_loss or cfg.preference.preference != OFF
    memory_model = None if model is None or model.custom is not None else MemoryModel(
        model, plan.hardware, plan.ranks, plan.rank_seq_len, cfg.speed, no_logits,
        cfg.model.gradient_checkpointing, bool(cfg.logging.generate_prompt and cfg.checkpoint.export),
        cfg.optim.delayed_update_from_step, request, cfg.model.offload_activations, cfg.model.tiled_mlp)
    choice = parameters = None
    micro = request.micro
    if memory_model is not None:
        ds, parameters = choose_whole_parameters(memory_model, ds, raw, micro, request.divides)
    if micro is None:
        if memory_model is not None:
            micro, choice = memory_model.largest_fitting_micro(ds, request.divides)
        elif model is not None and model.custom is not None and model.custom.activation_bytes is not None:
            micro, choice = choose_micro_batch(
                plan.seq_len, plan.hardware.gpu_memory_gib,
                lambda m: custom_peak_bytes(model, ds, plan.ranks, m), request.divides)
        else:
            micro, choice = choose_micro_batch(plan.seq_len, None, None, request.divides)
            if model is not None and model.custom is not None:  # no activation figure: the default, said so
                choice = (f"auto: {micro} (the default: your model defines no activation_bytes(micro_batch), so the "
                          "plan cannot size it; give --micro_batch_size or define the hook)")
    batch, said, found = settle_batch(request, micro, plan.seq_len)
    notes += said
    problems += found
    if batch is None:
        return dataclasses.replace(plan, memory_model=memory_model, parameters_choice=parameters), problems, notes
    ds, notes, problems = with_batch(ds, batch, notes, problems)
    if plan.sequence_parallel > 1 and ds is not None:  # DeepSpeed's batch is over the data-parallel ranks
        ds["sequence_parallel_size"] = plan.sequence_parallel
    compiled = memory_model.compiles(ds) if memory_model else False
    if compiled and dsc.zero_stage(ds) == 3:
        ds = dsc.with_layer_prefetch(ds, raw, model.layer_params)
    return (dataclasses.replace(plan, ds_config=ds, batch=batch, micro_batch_choice=choice, memory_model=memory_model,
                                compiled_layers=compiled, parameters_choice=parameters),
            problems, notes)


def hidden_size(model: ModelPlan | None) -> int | None:
    """What DeepSpeed's "auto" bucket sizes scale with: the model's hidden size (a model of your own: its width)."""
    if model is None:
        return None
    return model.custom.width if model.custom is not None else model.config.hidden_size


def plan_memory(plan: Plan) -> tuple[Plan, list[Problem]]:
    """The recomputed layers, the prefetch, each phase's memory, the host's share, and the checkpoints' writes."""
    memory_model, ds, batch, model = plan.memory_model, plan.ds_config, plan.batch, plan.model
    layers, layers_choice, problems = choose_checkpointed_layers(plan.cfg, memory_model, ds, batch.micro)
    prefetch, prefetch_choice = choose_prefetch(plan.cfg.speed, memory_model, ds, batch.micro, layers)
    offloaded = layers and plan.cfg.model.offload_activations  # layers None: no layer recomputes
    memory = MemoryEstimate(
        phases=memory_model.phases(ds, batch.micro, layers, prefetch),
        checkpointed_layers=layers, checkpointed_layers_choice=layers_choice,
        delayed_prefetch=prefetch, delayed_prefetch_choice=prefetch_choice,
        host_bytes=memory_model.host_bytes(ds),
        resume_host_bytes=resume_host_bytes(model.trainable_params, plan.ranks, plan.hardware.ranks_per_node,
                                            dsc.offloads(ds)[0], memory_model.gpu_optimizer_share(ds)),
        activation_host_bytes=(plan.hardware.ranks_per_node
                               * plan.offloaded_bytes(plan.rank_seq_len, batch.micro, layers) if offloaded else 0.0),
        tiled_mlp=memory_model.tiles_mlp(ds, batch.micro, layers, prefetch))
    writes = plan_checkpoint_writes(plan.cfg.checkpoint.background_checkpoint, checkpoint_bytes(plan),
                                    any(dsc.offloads(ds)), plan.hardware, plan.ranks)
    return dataclasses.replace(plan, memory=memory, checkpoints=writes), problems


def checkpoint_bytes(plan: Plan) -> float:
    """One checkpoint on disk: the trained parameters' 16-bit weights, fp32 master weights and Adam moments (fp32
    training: weights and moments), 5% beside (LoRA: no frozen weight)."""
    bf16 = dsc.precision(plan.ds_config) != "fp32"
    return plan.model.trainable_params * (2 + 12 if bf16 else 4 + 8) * 1.05


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


def find_data_source(cfg: TrainConfig, tokenizer, vision: bool = False) -> tuple[object, str | None, list[Problem]]:
    """What --dataset means (files, a saved dataset, the hub, the embedded corpus) and what its rows hold (a
    fine-tuning format or pretraining text, from --data_format and the columns; rows with images for a
    vision-language model); the data themselves are read by the preflight's sample check and the run's
    tokenization."""
    if cfg.data.dummy_data or tokenizer is None:
        return None, None, []
    if is_user_function(cfg.data.dataset):  # read by its function (data.custom), checked by the preflight
        return None, "custom", []
    try:
        source = resolve_source(cfg.data)
        if vision:
            return source, vision_data_format(cfg.data, source), []
        return source, resolve_run_format(cfg.data, source, cfg.preference.preference != OFF), []
    except DataError as e:
        return None, None, [e.problem]


