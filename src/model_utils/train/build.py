"""A run built from its checked plan (planning.preflight.checked_plan): the engine's DeepSpeed config, the data on every
rank, the model with its speed options and adapters, the DeepSpeed engine and its patches, then the resume.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

import deepspeed
import torch
from transformers.integrations import HfDeepSpeedConfig

from model_utils.checkpoint.background import BackgroundSaves, install
from model_utils.checkpoint.protocol import convert_to_universal, data_position_problems, needs_universal
from model_utils.config import deepspeed as dsc
from model_utils.config.fine_tuning import apply_weight_decay, settle_epochs, with_fine_tuning_defaults
from model_utils.config.preference import preference_settings
from model_utils.config.settings import TrainConfig
from model_utils.config.stages import read_stages
from model_utils.core.problems import ConfigError
from model_utils.core.user_code import is_user_function
from model_utils.data.blocks import BlockOrder, DataPosition, PackedData
from model_utils.data.custom.dataset import UserData, load_user_data
from model_utils.data.pipeline import prepare_data
from model_utils.data.sft.packing import PackedExamples
from model_utils.data.streaming import identity_entry, is_streamed
from model_utils.data.tokens import token_fingerprint, tokenizer_identity
from model_utils.models.build import build_model, decay_groups, gpu_peak_tflops
from model_utils.models.custom.contract import build_for_training
from model_utils.models.document_attention import KERNEL_LABELS, takes_document_boundaries
from model_utils.models.lora import LoraError, apply_lora, summary
from model_utils.models.offload import HostActivations
from model_utils.models.quantization import Quantization, prepare_for_training
from model_utils.models.sequence_parallel import enable_ulysses, tile_mlps, uses_tiled_mlp
from model_utils.models.speed import apply_speed_options, register_lm_head_for_zero3, streamline_zero_step
from model_utils.models.vision.build import build_vision_model
from model_utils.models.vision.parts import keep_lr_scales, lr_scales, part_groups
from model_utils.models.vision.tower import run_tower_on_every_batch
from model_utils.patches.deepspeed_offload import delay_offload_updates
from model_utils.patches.deepspeed_zero3 import keep_partial_offload_state
from model_utils.planning.custom import data_settings
from model_utils.planning.plan import Plan, hidden_size
from model_utils.planning.stages import group_matchers
from model_utils.runtime.distributed import Dist
from model_utils.runtime.monitor import Sinks, describe_ds_config, prepare_ds_monitor, start_run_log
from model_utils.runtime.process import pinned_memory_line, seed_everything, share_host_cores
from model_utils.runtime.run_log import Logger, bars_only_on_a_terminal
from model_utils.train.reference import check_resumed_reference, prepare_reference
from model_utils.train.resume import load_checkpoint
from model_utils.train.run import Run
from model_utils.train.stages import StageSchedule, enter_stage, plan_curriculum, stage_groups


# ----------------------------------------------------------------------------------------------------------------------
# Build: plan -> data -> model -> engine -> resume
# ----------------------------------------------------------------------------------------------------------------------
def start_log(cfg: TrainConfig, dist: Dist) -> Logger:
    """The run's log, its header (job, nodes, world size, versions, effective flags) and this rank's host threads."""
    bars_only_on_a_terminal()
    log = Logger(dist, cfg.checkpoint.run_dir.metrics)
    start_run_log(log, cfg, dist)
    log.info(share_host_cores())  # before DeepSpeedCPUAdam or any thread pool starts
    if torch.cuda.is_available():
        log.info(pinned_memory_line())  # the host copies of background saves, DeepSpeed's offload buffers
    return log


def build_run(plan: Plan, dist: Dist, log: Logger) -> Run:
    """The run of a checked plan (planning.preflight.checked_plan: every rank holds the same resume point and data
    source): the engine's DeepSpeed config, the data, the model and engine, then the resume."""
    dist.sequence_parallel = plan.cfg.model.sequence_parallel  # the plan checked that it divides the ranks
    ds, resume_tag = engine_config(plan, dist, log)
    loaded = load_data(plan, ds, dist, log)
    cfg, ds = loaded.cfg, loaded.ds_config
    model, engine, in_force, saves = build_engine(plan, loaded, dist, log)
    documents = cfg.data.document_mask or loaded.examples  # examples: positions restart at each one
    run = Run(cfg, dist, cfg.checkpoint.run_dir, ds, plan.tokenizer, model, engine, loaded.data, loaded.order,
              plan.batch, plan.model.flops, log, data_identity=loaded.identity, speed_in_force=in_force,
              peak_tflops=gpu_peak(dist), position=DataPosition(), saves=saves, incomplete_moved=plan.incomplete_moved,
              document_eos=plan.tokenizer.eos_token_id if cfg.data.document_mask and not loaded.examples else None,
              document_boundaries=documents and (takes_document_boundaries(model) or dist.sequence_parallel > 1),
              lora=plan.model.lora, vision=plan.model.vision, custom=plan.model.custom, stages=loaded.stages,
              examples=loaded.examples, preference=preference_settings(cfg),
              offload=HostActivations(pinned=dist.device.type == "cuda") if cfg.model.offload_activations else None)
    describe_run(run, plan, loaded.length)
    run.reference = prepare_reference(run, plan)  # the step-0 model's: before any checkpoint is loaded
    if plan.resume:
        load_checkpoint(run, plan.resume, resume_tag)
        check_resumed_reference(run, plan.resume.manifest)
    if run.stages is not None:  # the stage the run is in: its data, at the position the checkpoint holds
        enter_stage(run, run.stages.index_at(run.step), fresh=False)
        for line in run.stages.describe():
            log.info(line)
    log.sinks = Sinks(cfg, run.run_dir, dist, ds, engine, run.step, log)  # TensorBoard / W&B (rank 0)
    return run


def engine_config(plan: Plan, dist: Dist, log: Logger) -> tuple[dict, str | None]:
    """The plan's DeepSpeed config as the engine takes it (DeepSpeed's own monitor writing into the run directory; a
    checkpoint of another world size converted to a universal one), and the checkpoint tag to load."""
    ds = copy.deepcopy(plan.ds_config)  # DeepSpeed and the universal-checkpoint load write into it
    prepare_ds_monitor(ds, plan.cfg.checkpoint.run_dir)
    resume_tag = plan.resume.path.name if plan.resume else None
    if plan.resume and needs_universal(plan.resume, dist.world_size, dsc.zero_stage(ds)):
        resume_tag = convert_to_universal(plan.resume, dist, log.info)
        ds.setdefault("checkpoint", {})["load_universal"] = True
    return ds, resume_tag


@dataclass(frozen=True)
class LoadedData:
    """The run's data, and what follows from them: with --num_epochs the run's length (the configuration's max_steps
    and the DeepSpeed scheduler settled from the packed data)."""

    data: PackedData
    order: BlockOrder
    identity: dict  # what the data position means (data_identity)
    examples: bool  # fine-tuning examples with their labels (sft_data), not concatenated text
    cfg: TrainConfig
    ds_config: dict
    length: object  # config.fine_tuning.EpochLength with --num_epochs, else None
    stages: object = None  # train.stages.Curriculum of a run with stages, else None


def load_data(plan: Plan, ds: dict, dist: Dist, log: Logger) -> LoadedData:
    """Every rank's data (rank 0 prepares, the others wait on its files), checked against the resume point."""
    cfg, batch = plan.cfg, plan.batch
    stages, _ = read_stages(cfg.curriculum.stages)  # checked by the plan
    if is_user_function(cfg.data.dataset):  # a dataset of your own, one per stage where a stage names its data_args
        built: dict = {}
        per_stage = []
        for stage in stages or (None,):
            settings = data_settings(cfg, plan.tokenizer, stage)
            key = repr(sorted(settings.args.items()))
            if key not in built:
                built[key] = load_user_data(cfg.data.dataset, settings, cfg.data.validation_fraction)
            per_stage.append(built[key])
        data = per_stage[0]
    else:
        data = prepare_data(cfg.data, plan.tokenizer, batch.seq_len, dist, log.info, source=plan.data_source,
                            seed=cfg.seed, data_format=plan.data_format,
                            processor=plan.model.vision.processor if plan.model.vision else None)
        per_stage = [data] * len(stages)
    curriculum = None
    if stages:  # the run's length: the stages' (epochs counted on each stage's data)
        curriculum = plan_curriculum(stages, per_stage, cfg.seed, dist.data_world, batch.micro, batch.accumulation)
        cfg = cfg.with_flags(max_steps=curriculum.total_steps)
    length = None
    if cfg.batch.num_epochs is not None:  # the length in steps follows from the packed data
        cfg, ds, length = settle_length(plan, ds, len(data.train_ids), dist.data_world, log)
    elif plan.fine_tuning is not None:
        log.info(plan.fine_tuning.describe())
    log.info(describe_ds_config(ds))
    identity = data_identity(cfg, plan.tokenizer, batch.seq_len, data, dist.data_world)
    if plan.resume:  # every rank alike: the same manifest (broadcast), the same data
        problems = data_position_problems(plan.resume.manifest, plan.resume.path, identity)
        if problems:
            raise ConfigError(problems)
    order = (data.order(dist.data_world, batch.micro) if is_streamed(data)  # a sequence-parallel group reads alike
             else curriculum.orders[0] if curriculum else BlockOrder(data.train_ids, cfg.seed, dist.data_world, batch.micro))
    for stage_data in {id(d): d for d in (curriculum.data if curriculum else [data])}.values():
        log.info(f"data: {stage_data.description}")
    return LoadedData(data, order, identity, is_example_data(data), cfg, ds, length, curriculum)


def build_engine(plan: Plan, loaded: LoadedData, dist: Dist, log: Logger):
    """(model, DeepSpeed engine, the speed options in force, background saves or None): the model built (under
    zero.Init for ZeRO-3), its speed options applied, LoRA's adapters where asked, the engine with its patches."""
    cfg, ds = loaded.cfg, loaded.ds_config
    seed_everything(cfg.seed)
    lora, vision = plan.model.lora, plan.model.vision
    quantization = Quantization(dsc.precision(ds), dsc.zero_stage(ds)) if lora and lora.load_in_4bit else None
    zero3_context = None
    if dsc.zero_stage(ds) == 3 and quantization is None:  # a 4-bit model is built whole, partitioned by initialize
        zero3_context = HfDeepSpeedConfig(ds)  # noqa: F841  (must stay alive while the model is built: zero.Init)
    if plan.model.custom is not None:  # a model of your own: its kernels are its own (no speed options applied)
        model = build_for_training(plan.model.custom.spec, plan.model.custom.settings, ds)
    elif vision is not None:
        model = build_vision_model(cfg.model.model, vision.config, torch.float32, cfg.model.attn_implementation,
                                   cfg.model.gradient_checkpointing, vision.frozen, plan.memory.checkpointed_layers,
                                   quantization, dist.device)
    else:
        model = build_model(cfg.model.model, plan.model.config, torch.float32, cfg.model.attn_implementation,
                            cfg.model.gradient_checkpointing, plan.memory.checkpointed_layers, quantization,
                            dist.device)
    if quantization is not None:
        prepare_for_training(model, log.info)
        log.info(f"QLoRA: {quantization.describe()}")
    in_force = {"fused_kernels": "off", "speed_options": "yours"} if plan.model.custom is not None else \
        apply_speed_options(model, cfg.speed, dist.device.type == "cuda", log.info,
                            warn=lambda message: log.warn(message, all_ranks=True),
                            documents=cfg.data.document_mask or loaded.examples, fused=plan.fused_loss,
                            compiled=plan.compiled_layers, seq_len=plan.seq_len,
                            loss_tokens=plan.batch.micro * plan.rank_seq_len)
    mpu = None
    if dist.sequence_parallel > 1:
        mpu = enable_ulysses(model, dist.sequence_parallel, plan.batch.micro, plan.seq_len, log.info)
    if plan.memory.tiled_mlp:
        in_force["tiled_mlp"] = tile_mlps(model, log.info)
    elif uses_tiled_mlp(cfg.model.tiled_mlp, plan.seq_len, dist.sequence_parallel):
        log.info("tiled MLP: off (--tiled_mlp auto: the step fits the GPU untiled by the estimate, and untiled MLPs "
                 "run inside the compiled layers without a recomputation of their own)")
    inner = model
    if lora is not None:
        model = wrap_with_adapters(model, lora, log)
    if zero3_context is not None:
        added_in_run_precision(model, dsc.precision(ds))

    wd = ds.get("optimizer", {}).get("params", {}).get("weight_decay", 0.0)
    if vision is not None:  # a learning rate per part
        groups = part_groups(model, decay_groups, wd, vision_lr_scales(vision, ds, cfg))
    else:
        matrices, others = decay_groups(model.parameters())
        groups = [{"params": matrices, "weight_decay": wd}, {"params": others, "weight_decay": 0.0}]
    schedule = None  # DeepSpeed's, from the config
    if loaded.stages is not None:  # grouped by the stages that train them; the stages' schedule replaces the config's
        groups = stage_groups(model, groups, loaded.stages.stages, group_matchers(plan.model))
        rate = ds.get("optimizer", {}).get("params", {}).get("lr")
        base = float(rate) if isinstance(rate, (int, float)) else 0.0
        schedule = lambda optimizer: StageSchedule(optimizer, loaded.stages, base)  # noqa: E731 (DeepSpeed calls it)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=groups, config=ds, mpu=mpu,
                                           lr_scheduler=schedule)
    if vision is not None:  # after ZeRO-3's hooks: the blank image runs once the embedding's are done, as images do
        inner.tower_on_every_batch = run_tower_on_every_batch(model, inner, vision.processor, dist.device)
        in_force["vision_tower_every_batch"] = "on"
    if quantization is not None and dsc.zero_stage(ds) == 3 and in_force["fused_kernels"] != "off":
        register_lm_head_for_zero3(model.get_base_model(), log.info)  # partitioned by initialize, not by zero.Init
    start_schedule(engine)
    if vision is not None and loaded.stages is None and keep_lr_scales(engine):
        log.info("learning rates: " + ", ".join(f"{g['part'].replace('_', ' ')} x{g['lr_scale']:g}"
                                                for g in engine.optimizer.param_groups[::2]) + " the schedule's")
    in_force.update(streamline_zero_step(engine, cfg.speed, log.info))
    from_step = cfg.optim.delayed_update_from_step
    delayed = delay_offload_updates(engine, from_step, log.info,  # ZeRO, optimizer offloaded
                                    prefetch=plan.memory.delayed_prefetch)
    in_force["delayed_update_from_step"] = from_step if delayed else 0
    prefetched = delayed and getattr(engine.optimizer.dslm_delayed_update, "staged", None)
    in_force["delayed_update_prefetch"] = "on" if prefetched else "off"
    keep_partial_offload_state(engine.optimizer, log.info)  # ZeRO-3 with offload_optimizer.ratio < 1
    saves = None
    if plan.checkpoints.background:
        saves = BackgroundSaves(install(engine, log.info), dist, log.info, metrics=log.metrics)
    return model, engine, in_force, saves


def vision_lr_scales(vision, ds: dict, cfg: TrainConfig) -> dict:
    """Each trained part's learning rate as a factor of the schedule's (--vision_tower_lr, --projector_lr over the
    optimizer's lr)."""
    rate = ds.get("optimizer", {}).get("params", {}).get("lr")
    return lr_scales(vision.frozen, rate if isinstance(rate, (int, float)) else 0.0, cfg.vision.vision_tower_lr,
                     cfg.vision.projector_lr)


def start_schedule(engine) -> None:
    """Step 1 trains at the schedule's first rate. DeepSpeed's schedulers (WarmupLR, WarmupDecayLR, WarmupCosineLR)
    are built at iteration -1, whose rate is 0.0, and step after each update: step 1 would train at 0.0 and step 2 at
    iteration 0's warm-up floor, two updates at zero where the schedule names one. Moving to iteration 0 here, as
    torch's schedulers do when built, makes step s train at iteration s - 1. A resume loads the scheduler's own
    iteration from the checkpoint after this."""
    scheduler = engine.lr_scheduler
    if scheduler is not None and getattr(scheduler, "last_batch_iteration", None) == -1:
        scheduler.step(0)


def gpu_peak(dist: Dist) -> float | None:
    """This GPU's dense bf16 peak in TFLOP/s for MFU; None on CPU or an unknown GPU."""
    return gpu_peak_tflops(torch.cuda.get_device_name(dist.device)) if dist.device.type == "cuda" else None


def describe_run(run: Run, plan: Plan, length) -> None:
    """The header lines of a built run: attention, model, batch, recomputed layers."""
    cfg, log, batch, ds = run.cfg, run.log, run.batch, run.ds_config
    # the documents' boundaries go to the kernel in force (under sequence parallelism: SDPA once per document where
    # neither FlashAttention-4 nor PyTorch's varlen runs)
    in_force = run.speed_in_force.get("attention_kernel", "sdpa")
    kernel = KERNEL_LABELS["sdpa-documents" if in_force == "sdpa" else in_force]
    if run.preference:
        log.info(run.preference.describe() + "; reference: " + (
            "none (reference-free)" if not run.preference.needs_reference else
            "the model with its adapters off (LoRA), under no_grad" if run.lora else
            "the step-0 model's log-probabilities, computed once before the first step"))
    if run.examples:
        log.info("attention: within each example (positions restart at every example, "
                 + (f"{kernel} takes the examples' boundaries)" if run.document_boundaries
                    else "transformers masks attention to each example)"))
    elif cfg.data.document_mask:
        log.info("attention: within documents (--document_mask; positions restart after each EOS, "
                 + (f"{kernel} takes the documents' boundaries)" if run.document_boundaries
                    else "transformers masks attention to each document)"))
    precision = dsc.precision(ds)
    if run.vision is not None:
        log.info(run.vision.describe() + "; the tower runs on every micro-batch (a blank image where it has none)")
    if run.custom is not None:
        log.info(run.custom.describe())
    log.info(f"model: {cfg.model.model}, {plan.model.num_params / 1e6:.1f}M parameters, "
             f"{plan.model.flops.per_token() / 1e9:.3f} GFLOP/token; "
             f"precision {precision}{' (dynamic loss scaling)' if precision == 'fp16' else ''}, "
             f"ZeRO stage {dsc.zero_stage(ds)}")
    log.info(f"batch: {batch.describe()}; "
             f"{batch.plan(cfg.batch.max_steps, max(run.data.train_tokens or 0, 1), is_streamed(run.data))}"
             + (f"; {length.description}" if length else "")
             + (f"; micro-batch {plan.micro_batch_choice}" if plan.micro_batch_choice else ""))
    layers = plan.memory.checkpointed_layers
    if layers is not None:
        log.info(f"activation checkpointing: {layers} of {plan.model.config.num_hidden_layers} decoder layers "
                 "recompute" + (f" ({plan.memory.checkpointed_layers_choice})"
                                if plan.memory.checkpointed_layers_choice else ""))


def settle_length(plan: Plan, ds: dict, training_blocks: int, world: int, log: Logger):
    """--num_epochs once the data are packed: (cfg whose max_steps is the step the run stops at, the DeepSpeed config
    whose scheduler counts the epochs' steps and takes the fine-tuning defaults where they apply, the EpochLength).
    Only the optimizer and scheduler sections change: the rest of `ds` is the plan's."""
    cfg, batch = plan.cfg, plan.batch
    length = settle_epochs(cfg.batch.num_epochs, training_blocks, world, batch.micro, batch.accumulation,
                           plan.resume.manifest if plan.resume else None)
    scheduled, defaults = with_fine_tuning_defaults(cfg.with_flags(max_steps=length.total_steps), length.total_steps)
    resolved, _, problems = dsc.resolve_settings(plan.raw_ds_config, scheduled, plan.hardware.precision,
                                                 hidden_size(plan.model))
    if problems:
        raise ConfigError(problems)
    apply_weight_decay(resolved, defaults)
    ds = copy.deepcopy(ds)
    for section in ("optimizer", "scheduler"):
        if section in resolved:
            ds[section] = resolved[section]
    if defaults is not None:
        log.info(defaults.describe())
    return dataclasses.replace(scheduled, batch=dataclasses.replace(scheduled.batch, max_steps=length.stop_step)), \
        ds, length


def is_example_data(data) -> bool:
    """Fine-tuning data: blocks of examples with their labels and positions (sft_data), not of concatenated text."""
    return isinstance(data.train, PackedExamples)


def wrap_with_adapters(model, settings, log: Logger):
    """The model with LoRA adapters (models.lora.apply_lora), its other weights frozen; bad settings stop every rank
    alike."""
    try:
        model = apply_lora(model, settings)
    except LoraError as e:
        raise ConfigError(e.problems) from e
    log.info(summary(model, settings).describe())
    return model


def added_in_run_precision(model, precision: str) -> None:
    """The parameters created after zero.Init built the model (peft's adapters, in fp32 beside a 16-bit base) in the
    run's 16-bit dtype, as DeepSpeed casts a model it did not build; ZeRO-3 flattens each group's trainable
    parameters into one buffer of one dtype (beside a trained projector in bf16, fp32 adapters stop its start)."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    for parameter in model.parameters() if dtype is not None else ():
        if not hasattr(parameter, "ds_id") and parameter.is_floating_point() and parameter.dtype != dtype:
            parameter.data = parameter.data.to(dtype)


def data_identity(cfg: TrainConfig, tokenizer, seq_len: int, data, world_size: int = 1) -> dict:
    """What a checkpoint's data position counts in: blocks of seq_len, tokens of this tokenizer, these training tokens
    (checkpoint.protocol.data_position_problems compares them on resume)."""
    if isinstance(data, UserData):  # a dataset of your own: its function, arguments, length and first items
        return {"tokenizer": cfg.model.tokenizer, "seq_len": seq_len, "data": data.identity}
    if is_streamed(data):  # a place in each rank's stream: no token array to digest
        return {"tokenizer": cfg.model.tokenizer, "tokenizer_identity": tokenizer_identity(tokenizer),
                "seq_len": seq_len, "data": identity_entry(data, world_size, cfg.data.stream_shuffle_blocks)}
    return {"tokenizer": cfg.model.tokenizer, "tokenizer_identity": tokenizer_identity(tokenizer), "seq_len": seq_len,
            "data": {"dataset": cfg.data.dataset if not cfg.data.dummy_data else f"--dummy_data {cfg.data.dummy_data}",
                     "tokens": len(data.train.tokens), "fingerprint": token_fingerprint(data.train.tokens)}}
