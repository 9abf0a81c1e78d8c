"""The trainer: a run built from its plan (model, DeepSpeed engine, data, resume), and the loop that trains it.

`build_run(plan, dist, log)` turns a checked plan (plan.py, preflight.checked_plan) into a `Run`; `train(run)` steps,
logs, evaluates, saves and stops, and returns the exit status. `train_step` and `agree_after_step` are the loop's own
step, which benchmarks/bench.py times.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import math
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .config import ConfigError, TrainConfig
from .run_dir import RunDir

if TYPE_CHECKING:  # the heavy libraries load inside build_run(), after the arguments are checked
    import torch
    from deepspeed import DeepSpeedEngine
    from transformers import PreTrainedTokenizerBase

    from .background_save import BackgroundSaves
    from .concat_dataset import BlockOrder, DataPosition, PackedData
    from .distributed import Dist
    from .ds_config import Batch
    from .models import FlopsModel
    from .plan import Plan
    from .run_log import Logger


@dataclass
class Run:
    """Everything the loop needs, built by `build_run`; `step`, `tokens_seen` and `position` advance as it trains."""

    cfg: TrainConfig
    dist: Dist
    run_dir: RunDir
    ds_config: dict  # resolved: no "auto" left
    tokenizer: PreTrainedTokenizerBase
    model: torch.nn.Module
    engine: DeepSpeedEngine
    data: PackedData
    order: BlockOrder
    batch: Batch  # micro-batch, accumulation, world size, block length
    flops: FlopsModel
    log: Logger
    data_identity: dict  # what the data position means (manifest: seq_len, tokenizer, data); see data_identity()
    speed_in_force: dict  # the speed options in force (apply_speed_options, streamline_zero_step, the delayed update)
    peak_tflops: float | None = None
    document_eos: int | None = None  # --document_mask: the token that ends a document
    document_boundaries: bool = False  # the attention takes documents as boundaries (FlashAttention-4), not a mask
    lora: object = None  # lora.LoraSettings of a LoRA run; None: every weight trains
    examples: bool = False  # fine-tuning data (sft_data): blocks of examples with their labels and positions
    step: int = 0
    tokens_seen: int = 0
    position: DataPosition | None = None
    saves: BackgroundSaves | None = None  # checkpoints written in the background, else None: saves block
    incomplete_moved: tuple[str, ...] = ()  # incomplete checkpoints this start moved aside (rank 0)


# ----------------------------------------------------------------------------------------------------------------------
# Build: plan -> data -> model -> engine -> resume
# ----------------------------------------------------------------------------------------------------------------------
def start_log(cfg: TrainConfig, dist: Dist) -> Logger:
    """The run's log, its header (job, nodes, world size, versions, effective flags) and this rank's host threads."""
    from .monitor import start_run_log
    from .process import share_host_cores
    from .run_log import Logger, bars_only_on_a_terminal

    bars_only_on_a_terminal()
    log = Logger(dist, cfg.checkpoint.run_dir.metrics)
    start_run_log(log, cfg, dist)
    log.info(share_host_cores())  # before DeepSpeedCPUAdam or any thread pool starts
    return log


def build_run(plan: Plan, dist: Dist, log: Logger) -> Run:
    """The run of a checked plan (preflight.checked_plan: every rank holds the same resume point and data source):
    the engine's DeepSpeed config, the data, the model and engine, then the resume."""
    from .concat_dataset import DataPosition
    from .monitor import Sinks
    from .patches.flash_attn4 import takes_document_boundaries

    ds, resume_tag = engine_config(plan, dist, log)
    loaded = load_data(plan, ds, dist, log)
    cfg, ds = loaded.cfg, loaded.ds_config
    model, engine, in_force, saves = build_engine(plan, loaded, dist, log)
    documents = cfg.data.document_mask or loaded.examples  # examples: positions restart at each one
    run = Run(cfg, dist, cfg.checkpoint.run_dir, ds, plan.tokenizer, model, engine, loaded.data, loaded.order,
              plan.batch, plan.model.flops, log, data_identity=loaded.identity, speed_in_force=in_force,
              peak_tflops=gpu_peak(dist), position=DataPosition(), saves=saves, incomplete_moved=plan.incomplete_moved,
              document_eos=plan.tokenizer.eos_token_id if cfg.data.document_mask and not loaded.examples else None,
              document_boundaries=documents and takes_document_boundaries(model), lora=cfg.model.lora_settings(),
              examples=loaded.examples)
    describe_run(run, plan, loaded.length)
    if plan.resume:
        load_checkpoint(run, plan.resume, resume_tag)
    log.sinks = Sinks(cfg, run.run_dir, dist, ds, engine, run.step, log)  # TensorBoard / W&B (rank 0)
    return run


def engine_config(plan: Plan, dist: Dist, log: Logger) -> tuple[dict, str | None]:
    """The plan's DeepSpeed config as the engine takes it (DeepSpeed's own monitor writing into the run directory; a
    checkpoint of another world size converted to a universal one), and the checkpoint tag to load."""
    from . import ds_config as dsc
    from .checkpoint import convert_to_universal, needs_universal
    from .monitor import prepare_ds_monitor

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
    length: object  # fine_tuning.EpochLength with --num_epochs, else None


def load_data(plan: Plan, ds: dict, dist: Dist, log: Logger) -> LoadedData:
    """Every rank's data (rank 0 prepares, the others wait on its files), checked against the resume point."""
    from .checkpoint import data_position_problems
    from .concat_dataset import BlockOrder, prepare_data
    from .monitor import describe_ds_config
    from .streaming import is_streamed

    cfg, batch = plan.cfg, plan.batch
    data = prepare_data(cfg.data, plan.tokenizer, batch.seq_len, dist, log.info, source=plan.data_source,
                        seed=cfg.seed, data_format=plan.data_format)
    length = None
    if cfg.batch.num_epochs is not None:  # the length in steps follows from the packed data
        cfg, ds, length = settle_length(plan, ds, len(data.train_ids), dist.world_size, log)
    elif plan.fine_tuning is not None:
        log.info(plan.fine_tuning.describe())
    log.info(describe_ds_config(ds))
    identity = data_identity(cfg, plan.tokenizer, batch.seq_len, data, dist.world_size)
    if plan.resume:  # every rank alike: the same manifest (broadcast), the same data
        problems = data_position_problems(plan.resume.manifest, plan.resume.path, identity)
        if problems:
            raise ConfigError(problems)
    order = (data.order(dist.world_size, batch.micro) if is_streamed(data)
             else BlockOrder(data.train_ids, cfg.seed, dist.world_size, batch.micro))
    log.info(f"data: {data.description}")
    return LoadedData(data, order, identity, is_example_data(data), cfg, ds, length)


def build_engine(plan: Plan, loaded: LoadedData, dist: Dist, log: Logger):
    """(model, DeepSpeed engine, the speed options in force, background saves or None): the model built (under
    zero.Init for ZeRO-3), its speed options applied, LoRA's adapters where asked, the engine with its patches."""
    import deepspeed
    import torch

    from . import ds_config as dsc
    from .models import build_model, decay_groups
    from .patches.deepspeed_offload import delay_offload_updates
    from .patches.deepspeed_zero3 import keep_partial_offload_state
    from .process import seed_everything
    from .speed import apply_speed_options, streamline_zero_step

    cfg, ds = loaded.cfg, loaded.ds_config
    seed_everything(cfg.seed)
    zero3_context = None
    if dsc.zero_stage(ds) == 3:
        from transformers.integrations import HfDeepSpeedConfig
        zero3_context = HfDeepSpeedConfig(ds)  # noqa: F841  (must stay alive while the model is built: zero.Init)
    model = build_model(cfg.model.model, plan.model.config, torch.float32, cfg.model.attn_implementation,
                        cfg.model.gradient_checkpointing, plan.memory.checkpointed_layers)
    in_force = apply_speed_options(model, cfg.speed, dist.device.type == "cuda", log.info,
                                   warn=lambda message: log.warn(message, all_ranks=True),
                                   documents=cfg.data.document_mask or loaded.examples, fused=plan.fused_loss,
                                   compiled=plan.compiled_layers)
    lora = cfg.model.lora_settings()
    if lora is not None:
        model = wrap_with_adapters(model, lora, log)

    matrices, others = decay_groups(model.parameters())
    wd = ds.get("optimizer", {}).get("params", {}).get("weight_decay", 0.0)
    groups = [{"params": matrices, "weight_decay": wd}, {"params": others, "weight_decay": 0.0}]
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=groups, config=ds)
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
        from .background_save import BackgroundSaves, install
        saves = BackgroundSaves(install(engine, log.info), dist, log.info)
    return model, engine, in_force, saves


def gpu_peak(dist: Dist) -> float | None:
    """This GPU's dense bf16 peak in TFLOP/s for MFU; None on CPU or an unknown GPU."""
    import torch

    from .models import gpu_peak_tflops

    return gpu_peak_tflops(torch.cuda.get_device_name(dist.device)) if dist.device.type == "cuda" else None


def describe_run(run: Run, plan: Plan, length) -> None:
    """The header lines of a built run: attention, model, batch, recomputed layers."""
    from . import ds_config as dsc
    from .streaming import is_streamed

    cfg, log, batch, ds = run.cfg, run.log, run.batch, run.ds_config
    if run.examples:
        log.info("attention: within each example (positions restart at every example, "
                 + ("FlashAttention-4 takes the examples' boundaries)" if run.document_boundaries
                    else "transformers masks attention to each example)"))
    elif cfg.data.document_mask:
        log.info("attention: within documents (--document_mask; positions restart after each EOS, "
                 + ("FlashAttention-4 takes the documents' boundaries)" if run.document_boundaries
                    else "transformers masks attention to each document)"))
    precision = dsc.precision(ds)
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
    from . import ds_config as dsc
    from .fine_tuning import apply_weight_decay, settle_epochs, with_fine_tuning_defaults

    cfg, batch = plan.cfg, plan.batch
    length = settle_epochs(cfg.batch.num_epochs, training_blocks, world, batch.micro, batch.accumulation,
                           plan.resume.manifest if plan.resume else None)
    scheduled, defaults = with_fine_tuning_defaults(cfg.with_flags(max_steps=length.total_steps), length.total_steps)
    resolved, _, problems = dsc.resolve_settings(plan.raw_ds_config, scheduled, plan.hardware.precision,
                                                 plan.model.config.hidden_size)
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
    from .sft_data import PackedExamples

    return isinstance(data.train, PackedExamples)


def wrap_with_adapters(model, settings, log: Logger):
    """The model with LoRA adapters (lora.apply_lora), its other weights frozen; bad settings stop every rank alike."""
    from .lora import LoraError, apply_lora, summary

    try:
        model = apply_lora(model, settings)
    except LoraError as e:
        raise ConfigError(e.problems) from e
    log.info(summary(model, settings).describe())
    return model


def data_identity(cfg: TrainConfig, tokenizer, seq_len: int, data, world_size: int = 1) -> dict:
    """What a checkpoint's data position counts in: blocks of seq_len, tokens of this tokenizer, these training tokens
    (checkpoint.data_position_problems compares them on resume)."""
    from .concat_dataset import token_fingerprint, tokenizer_identity
    from .streaming import identity_entry, is_streamed

    if is_streamed(data):  # a place in each rank's stream: no token array to digest
        return {"tokenizer": cfg.model.tokenizer, "tokenizer_identity": tokenizer_identity(tokenizer),
                "seq_len": seq_len, "data": identity_entry(data, world_size, cfg.data.stream_shuffle_blocks)}
    return {"tokenizer": cfg.model.tokenizer, "tokenizer_identity": tokenizer_identity(tokenizer), "seq_len": seq_len,
            "data": {"dataset": cfg.data.dataset if not cfg.data.dummy_data else f"--dummy_data {cfg.data.dummy_data}",
                     "tokens": len(data.train.tokens), "fingerprint": token_fingerprint(data.train.tokens)}}


def load_checkpoint(run: Run, info, tag: str):
    import torch

    from .checkpoint import rng_state_file, world_size_changed
    from .concat_dataset import DataPosition
    from .ds_config import optimisation_changes
    from .process import set_rng_state
    from .streaming import resume_stream

    _, client = run.engine.load_checkpoint(str(info.path.parent), tag=tag, **checkpoint_options(run)[1])
    if client is None:
        raise RuntimeError(f"DeepSpeed could not load {info.path}")
    run.step, run.tokens_seen = client["step"], client["tokens_seen"]
    run.position = DataPosition.from_state_dict(client["data_position"])
    rng_file = rng_state_file(info.path, run.dist.rank)
    rank_state = None
    if world_size_changed(info, run.dist.world_size):
        run.log.warn("resume: the world size changed, so each rank's RNG state starts fresh (data order and model "
                     "state continue exactly)")
    elif rng_file.exists():
        rank_state = torch.load(rng_file, weights_only=False)
        set_rng_state(rank_state)
    resume_stream(run.data, rank_state, info.path, run.log.info)
    run.log.info(f"resume: continuing from {info.path} at step {run.step} "
                 f"(epoch {run.position.epoch}, {run.position.blocks_consumed} blocks into it)")
    changed = speed_changes(info.manifest or {}, run.cfg.speed, run.speed_in_force, run.step)
    if changed:
        run.log.warn("resume: speed options that change the numerics differ from the checkpoint's "
                     f"({'; '.join(changed)}): the run continues, but its losses will not match an uninterrupted "
                     "run's bit for bit")
    changed = optimisation_changes((info.manifest or {}).get("ds_config", {}), run.ds_config)
    if changed:
        run.log.warn(f"resume: the optimisation differs from the checkpoint's run ({'; '.join(changed)}): the run "
                     "continues with this run's values; the same settings continue it exactly")
        apply_schedule_at_resume(run.engine)


def apply_schedule_at_resume(engine) -> None:
    """The loaded optimizer's groups hold the learning rate the checkpoint's schedule set after its last step; this
    run's schedule (another length or rate) gives the same iteration its own, which the first resumed step takes.
    DeepSpeed's schedulers recompute it for a given iteration with step(iteration)."""
    scheduler = engine.lr_scheduler
    if scheduler is not None and hasattr(scheduler, "last_batch_iteration"):
        scheduler.step(scheduler.last_batch_iteration)


def checkpoint_options(run: Run) -> tuple[dict, dict]:
    """(engine.save_checkpoint's, engine.load_checkpoint's) extra arguments: a LoRA run's checkpoints leave the frozen
    weights out (lora.checkpoint_options), which the resumed run has from the pretrained model."""
    from .lora import checkpoint_options as lora_options

    return lora_options() if run.lora else ({}, {})


def speed_changes(manifest: dict, speed, in_force: dict | None, resumed_at: int = 0) -> list[str]:
    """The numerics-changing speed options that differ from a checkpoint's manifest: the settings, and what those
    settings resolved to on the machine (an `auto` that chose another kernel in another environment); and the delayed
    update, where it now delays other steps after `resumed_at` than the run that wrote the checkpoint would have."""
    changes = speed.numerics_changes(manifest.get("perf", {}))
    recorded = manifest.get("levers_in_force", {})
    in_force = in_force or {}
    changes += [f"{name} in force: {recorded[name]} -> {value}" for name, value in in_force.items()
                if name in speed.numerics_options() and name in recorded and recorded[name] != value]

    def first_delayed(from_step: int) -> str:  # the first step after the resume point whose update is delayed
        return f"from step {max(from_step, resumed_at + 1)}" if from_step else "off"

    key = "delayed_update_from_step"
    if key in recorded and key in in_force and first_delayed(recorded[key]) != first_delayed(in_force[key]):
        changes.append(f"delayed update: {first_delayed(recorded[key])} -> {first_delayed(in_force[key])}")
    return changes


# ----------------------------------------------------------------------------------------------------------------------
# Steps
# ----------------------------------------------------------------------------------------------------------------------
def model_inputs(run: Run, blocks) -> dict:
    """The model's keyword arguments for packed blocks of seq_len + 1 tokens (a host array): inputs are each block's
    first T tokens, targets its last T (already shifted). With --document_mask, positions restart after each EOS,
    from which transformers masks attention to each document; FlashAttention-4 takes the documents' boundaries
    instead. Both come from the host's copy of the tokens: nothing waits on the GPU for them."""
    import torch

    from .concat_dataset import document_boundaries, document_positions

    from .sft_data import ExampleBatch

    device = run.dist.device
    if isinstance(blocks, ExampleBatch):
        return example_inputs(run, blocks)
    on_device = to_device(blocks, device)
    inputs, targets = on_device[:, :-1].contiguous(), on_device[:, 1:].contiguous()
    batch = {"input_ids": inputs, "labels": targets, "shift_labels": targets}
    if run.document_eos is not None:
        positions = document_positions(blocks[:, :-1], run.document_eos)
        batch["position_ids"] = to_device(positions, device)
        if run.document_boundaries:
            boundaries = to_device(document_boundaries(positions), device)
            torch._dynamo.maybe_mark_dynamic(boundaries, 0)  # their count varies: one compiled graph for all
            batch.update(cu_seq_lens_q=boundaries, cu_seq_lens_k=boundaries, max_length_q=run.batch.seq_len,
                         max_length_k=run.batch.seq_len)
    return batch


def example_inputs(run: Run, batch) -> dict:
    """The model's keyword arguments for a batch of packed examples (sft_data.ExampleBatch): its targets (-100 outside
    the answers) and positions restarting at every example; FlashAttention-4 takes the examples' boundaries."""
    import torch

    arrays = batch.model_arrays(run.document_boundaries)
    inputs = {k: to_device(v, run.dist.device) if hasattr(v, "shape") else v for k, v in arrays.items()}
    if "cu_seq_lens_q" in inputs:
        torch._dynamo.maybe_mark_dynamic(inputs["cu_seq_lens_q"], 0)  # their count varies: one compiled graph
    return inputs


def attention_area(run: Run, blocks) -> int:
    """The query-key pairs the blocks' attention covers, for FLOPs and MFU: T² per block, or each document's length
    squared with --document_mask, each example's with fine-tuning data (model FLOPs: what the kernel computes, or
    skips, does not change them)."""
    from .concat_dataset import attention_area as document_area, document_positions

    from .sft_data import ExampleBatch

    if isinstance(blocks, ExampleBatch):
        return document_area(blocks.position_ids)
    if run.document_eos is None:
        return len(blocks) * run.batch.seq_len ** 2
    return document_area(document_positions(blocks[:, :-1], run.document_eos))


def compute_loss(engine, batch: dict):
    """Mean next-token loss over the batch (`model_inputs`)."""
    return engine(**batch, use_cache=False).loss


@dataclass
class StepResult:
    """One optimizer step on this rank, its tensors still on the device (nothing here waits for the GPU)."""

    loss_sum: object  # the micro-batches' losses summed (float64; a non-finite one counts 0)
    nonfinite: object  # whether any micro-batch's loss was inf/NaN (bool)
    attention_area: int  # query-key pairs the step's attention covered (FLOPs)
    blocks: list  # the block indices this rank read, in order (--trace_data)


@dataclass
class StepFlags:
    """What every rank decided together after a step (`agree_after_step`)."""

    stop: bool  # a stop signal reached some rank
    nonfinite_loss: bool  # some rank's loss was not finite
    save_due: bool  # rank 0's clock says a save is due (--checkpoint_minutes)


def _no_phase(name: str):
    return NO_PHASE


NO_PHASE = contextlib.nullcontext()


def train_step(run: Run, phase=_no_phase) -> StepResult:
    """One optimizer step: grad_accum micro-batches of forward and backward, DeepSpeed applying the update at the
    accumulation boundary, the data position advanced. `phase(name)` wraps the forward, backward and step of each
    micro-batch in a context (benchmarks/profiling.py); the training loop and benchmarks/bench.py both call this."""
    import torch

    dist, engine = run.dist, run.engine
    loss_sum = torch.zeros((), device=dist.device, dtype=torch.float64)
    nonfinite = torch.zeros((), device=dist.device, dtype=torch.bool)
    blocks_read, area = [], 0
    # Packed examples: the step's micro-batches read up front, to weight each one's mean loss by its loss tokens
    ahead = step_micro_batches(run) if run.examples else None
    weights = loss_token_weights(run, [blocks for _, blocks in ahead]) if ahead else None
    for micro in range(run.batch.accumulation):
        with phase("forward"):
            indices, blocks = ahead[micro] if ahead else read_micro_batch(run, run.position)
            blocks_read += indices.tolist()
            area += attention_area(run, blocks)
            loss = compute_loss(engine, model_inputs(run, blocks))
            if weights is not None:
                loss = loss * weights[micro]
        with phase("backward"):
            engine.backward(loss)
        with phase("step"):
            engine.step()
            run.position = run.order.advance(run.position)
        nonfinite |= ~torch.isfinite(loss.detach())
        loss_sum += torch.nan_to_num(loss.detach().double(), nan=0.0, posinf=0.0, neginf=0.0)
    run.step += 1
    run.tokens_seen += run.batch.tokens_per_step
    return StepResult(loss_sum, nonfinite, area, blocks_read)


def read_micro_batch(run: Run, position) -> tuple:
    """(block indices, blocks) of this rank's micro-batch at data `position`."""
    indices = run.order.rank_indices(position, run.dist.rank)
    return indices, run.data.train.batch(indices)


def step_micro_batches(run: Run) -> list[tuple]:
    """This rank's micro-batches of the coming step, in order (the data position is not advanced)."""
    position, micro_batches = run.position, []
    for _ in range(run.batch.accumulation):
        micro_batches.append(read_micro_batch(run, position))
        position = run.order.advance(position)
    return micro_batches


def loss_token_weights(run: Run, micro_batches: list):
    """Per micro-batch, the factor on its mean loss that makes the step's gradient the mean over the loss tokens of
    the whole step, every rank's (Hugging Face's num_items_in_batch): its loss tokens over the step's, times the
    micro-batches per step and the ranks, whose averages DeepSpeed and the loss log take. Without it a micro-batch
    with few answer tokens would weigh as much as one with many. One all-reduce of the step's count."""
    import torch

    counts = torch.tensor([float(blocks.loss_tokens) for blocks in micro_batches], dtype=torch.float64)
    counts = counts.to(run.dist.device)
    total = run.dist.all_reduce(counts.sum())
    return (counts * (len(micro_batches) * run.dist.world_size) / total).float()


def agree_after_step(run: Run, result: StepResult, stop_received: bool = False, save_due: bool = False) -> StepFlags:
    """The one collective after every step: a stop signal on any rank, a non-finite loss, an update the GPU skipped
    (--overflow_check device: booked here as DeepSpeed books one it skips), a save due by rank 0's clock, and the
    state of a checkpoint written in the background (committed once every rank has written it)."""
    import torch

    from .patches.deepspeed_zero import device_skip_flag, settle_device_skip

    dist = run.dist
    writes = run.saves.local_state() if run.saves else 0.0
    flags = torch.stack([torch.tensor(float(stop_received), device=dist.device), result.nonfinite.float(),
                         device_skip_flag(run.engine, dist.device), torch.tensor(float(save_due), device=dist.device),
                         torch.tensor(writes, device=dist.device)])
    dist.all_reduce(flags, torch.distributed.ReduceOp.MAX)
    stop, nonfinite_loss, skipped_on_device, save_due = (flags[:4] > 0).tolist()
    if run.saves:
        run.saves.agreed(flags[4].item())
    if skipped_on_device:
        settle_device_skip(run.engine)
    return StepFlags(stop, nonfinite_loss, save_due)


def to_device(array, device):
    import torch

    tensor = torch.from_numpy(array)
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor


def evaluate(run: Run) -> dict:
    import torch

    from .evaluation import evaluation_loss
    from .patches.deepspeed_offload import settle

    settle(run.engine)  # the model with every step's update (--delayed_update_from_step)
    ids = run.data.val_ids
    if len(ids) == 0:
        return {}
    engine, dist, m = run.engine, run.dist, run.batch.micro
    engine.eval()
    sums = torch.zeros(2, device=dist.device, dtype=torch.float64)  # the loss summed over its targets, their count
    with torch.no_grad():
        for i in range(run.cfg.logging.eval_iters):
            start = (i * dist.world_size + dist.rank) * m
            picks = [ids[(start + j) % len(ids)] for j in range(m)]
            summed, targets = evaluation_loss(engine, run.model, model_inputs(run, run.data.val.batch(picks)))
            sums += torch.stack([summed, targets])
    engine.train()
    loss_sum, targets = dist.all_reduce(sums).tolist()
    loss = loss_sum / max(targets, 1)
    return {"eval_loss": loss, "eval_ppl": math.exp(min(loss, 50.0))}


def log_evaluation(run: Run, label: str):
    result = evaluate(run)
    if result:
        run.log.metrics({"step": run.step, **result})
        run.log.info(f"{label} step {run.step}: loss {result['eval_loss']:.4f}, perplexity {result['eval_ppl']:.2f}")


def save(run: Run, wait: bool = False):
    """Save a checkpoint of this step on every rank. In the background (run.saves), training goes on once the state
    is in host memory, after the checkpoint still in flight, if any, is complete; `wait` also finishes this one."""
    from deepspeed.checkpoint.constants import (UNIVERSAL_CHECKPOINT_INFO, UNIVERSAL_CHECKPOINT_VERSION_KEY,
                                                UNIVERSAL_CHECKPOINT_VERSION_VALUE)

    from .checkpoint import SaveContext, save_checkpoint
    from .ds_config import zero_stage
    from .patches.deepspeed_offload import settle
    from .process import rng_state
    from .streaming import with_stream_state

    settle(run.engine)  # a checkpoint holds every step's update; the run resumed from it continues the same way

    ctx = SaveContext(run.run_dir.root, run.cfg.checkpoint.keep_last_checkpoints,
                      {"model": run.cfg.model.model, **run.data_identity, "zero_stage": zero_stage(run.ds_config),
                       "ds_config": run.ds_config, "perf": run.cfg.speed.as_dict(),
                       "levers_in_force": run.speed_in_force,
                       "lora": run.lora.as_manifest() if run.lora else None},
                      save_options=checkpoint_options(run)[0])
    client = {"step": run.step, "tokens_seen": run.tokens_seen, "data_position": run.position.state_dict(),
              # lets `ds_to_universal` convert the checkpoint for another world size (data parallelism only)
              UNIVERSAL_CHECKPOINT_INFO: {UNIVERSAL_CHECKPOINT_VERSION_KEY: UNIVERSAL_CHECKPOINT_VERSION_VALUE}}
    rank_state = with_stream_state(rng_state(), run.data)  # each rank's file: its RNG, its place in a stream
    t0 = time.perf_counter()
    if run.saves is None:
        save_checkpoint(run.engine, ctx, run.step, client, rank_state, run.dist, run.log.info)
    else:
        run.saves.finish()  # one checkpoint in flight at a time
        waited = time.perf_counter() - t0
        run.saves.started(save_checkpoint(run.engine, ctx, run.step, client, rank_state, run.dist, run.log.info,
                                          run.saves.writer))
        run.log.info(f"checkpoint: step {run.step} in host memory after {time.perf_counter() - t0:.1f}s"
                     + (f" ({waited:.1f}s waiting for the previous save)" if waited >= 0.05 else "")
                     + ("; waiting for its writes (the last step, or a stop)" if wait else
                        "; writing it in the background"))
        if wait:
            run.saves.finish()
    run.log.metrics({"step": run.step, "checkpoint_s": time.perf_counter() - t0})  # how long training stood still


# ----------------------------------------------------------------------------------------------------------------------
# The loop
# ----------------------------------------------------------------------------------------------------------------------
def train(run: Run) -> int:
    """The loop: step, log, evaluate, agree, judge the update, save or stop. Returns the exit status."""
    from tqdm import tqdm

    from .exit_status import NONFINITE, OK, STOPPED_BY_SIGNAL
    from .process import StopSignal

    cfg, log = run.cfg, run.log
    stop = StopSignal()
    interval, nonfinite, saves, trace = Interval(run), NonfiniteSteps(run), SaveSchedule(run), DataTrace(run)
    # A progress bar on a terminal only: in a job's log file its redraws would be lines of carriage returns, and the
    # log lines every --log_interval steps say the same.
    log.bar = tqdm(total=cfg.batch.max_steps, initial=run.step, desc="train", dynamic_ncols=True,
                   disable=not (run.dist.is_main and sys.stderr.isatty()))
    run.engine.train()
    while run.step < cfg.batch.max_steps:
        # --- one optimizer step at this learning rate ---
        lr = run.engine.get_lr()[0]
        t0 = time.perf_counter()
        result = train_step(run)
        interval.add(result, time.perf_counter() - t0)
        trace.write(run.step, result.blocks)

        # --- logging: the interval's loss averaged over its micro-batches on all ranks ---
        if run.step % cfg.logging.log_interval == 0 or run.step == cfg.batch.max_steps:
            interval.log(lr)
        log.bar.update(1)

        # --- evaluation ---
        if cfg.logging.eval_interval and run.step % cfg.logging.eval_interval == 0 and run.step < cfg.batch.max_steps:
            log_evaluation(run, "eval")

        # --- what all ranks decide together, in one collective ---
        agreed = agree_after_step(run, result, bool(stop.received), saves.clock_says_save())

        # --- a non-finite loss or gradient: stop without saving after too many, the last checkpoint is good ---
        bad, give_up = nonfinite.judge(agreed)
        if give_up:
            log.warn(f"stopping after {nonfinite.count} consecutive non-finite step(s) (--max_bad_steps "
                     f"{cfg.optim.max_bad_steps}); no checkpoint written, the last saved one is intact. Lower the learning "
                     "rate, raise warmup, or check the data")
            return end_early(run, NONFINITE, f"stopped: {nonfinite.count} consecutive non-finite step(s)")

        # --- checkpoint, and stop when a signal asked for it (all ranks agree) ---
        if saves.due(agreed, bad):
            saves.save(wait=agreed.stop or run.step == cfg.batch.max_steps)
        if agreed.stop and run.step < cfg.batch.max_steps:
            log.info(f"stop: {stop.received or 'a signal on another rank'} received; checkpoint saved at step "
                     f"{run.step}; exiting with status {STOPPED_BY_SIGNAL} so the job can be requeued")
            return end_early(run, STOPPED_BY_SIGNAL, f"preempted: {stop.received or 'signal on another rank'} at "
                                                     f"step {run.step} (requeue resumes)")
    log.bar.close()
    log.bar = None
    finish(run)
    return OK


def end_early(run: Run, status: int, why: str) -> int:
    """Every early exit of the loop: the progress bar closed, a checkpoint in flight completed (it was saved at a
    good step), the summary written with the exit status."""
    from .monitor import write_summary

    run.log.bar.close()
    if run.saves:
        run.saves.finish()
    write_summary(run, f"{why}, exit {status}")
    return status


class Interval:
    """The log interval on this rank: the losses, attention pairs and host step time summed over its steps; `log`
    turns them into the interval's record (two collectives, at log steps only) and starts the next interval."""

    def __init__(self, run: Run):
        import torch

        from .run_log import Throughput

        self.run = run
        self.throughput = Throughput(run.peak_tflops, run.dist.world_size)
        self.loss_sum = torch.zeros((), device=run.dist.device, dtype=torch.float64)
        self.steps, self.area, self.step_time = 0, 0, 0.0

    def add(self, result: StepResult, seconds: float) -> None:
        self.loss_sum += result.loss_sum
        self.area += result.attention_area
        self.step_time += seconds
        self.steps += 1

    def log(self, lr: float) -> dict:
        import torch

        from .run_log import memory_stats

        run, dist, engine = self.run, self.run.dist, self.run.engine
        sums = torch.stack([self.loss_sum, torch.tensor(float(self.area), device=dist.device, dtype=torch.float64)])
        loss_total, area_total = dist.all_reduce(sums).tolist()
        mean_loss = loss_total / (self.steps * run.batch.accumulation * dist.world_size)
        tokens = self.steps * run.batch.tokens_per_step
        # slowest and fastest rank's mean step time (max of t and of -t: one collective)
        times = torch.tensor([self.step_time, -self.step_time], device=dist.device, dtype=torch.float64) / self.steps
        slowest, fastest = dist.all_reduce(times, torch.distributed.ReduceOp.MAX).tolist()
        grad_norm = engine.get_global_grad_norm()
        record = {"step": run.step, "loss": mean_loss, "lr": lr,
                  "grad_norm": float(grad_norm) if grad_norm is not None else None,
                  "skipped_steps": engine.skipped_steps, **loss_scale(engine), "tokens_seen": run.tokens_seen,
                  **self.throughput.read(tokens, run.flops.flops(tokens, area_total)),
                  "step_time_s": slowest, "step_time_min_s": -fastest, **memory_stats(dist.device)}
        run.log.metrics(record)
        run.log.bar.set_postfix(loss=f"{mean_loss:.4f}", lr=f"{lr:.2e}", refresh=False)
        run.log.info(format_record(record))
        self.loss_sum.zero_()
        self.steps, self.area, self.step_time = 0, 0, 0.0
        return record


class NonfiniteSteps:
    """Consecutive steps whose loss or gradient was not finite. What DeepSpeed did decides, not the config: it skips
    such an update where it checks for overflow (fp16's loss scaling, bf16's check_grad_overflow, on by default) and
    applies it otherwise (fp32). The run gives up after --max_bad_steps skipped in a row, or after one applied."""

    def __init__(self, run: Run):
        from .ds_config import precision

        self.run, self.count = run, 0
        self.precision = precision(run.ds_config)

    def judge(self, agreed: StepFlags) -> tuple[bool, bool]:
        """(this step was bad, the run must stop); every rank decides the same from what all agreed on."""
        engine, log = self.run.engine, self.run.log
        skipped = not engine.was_step_applied()
        if skipped and self.precision == "fp16" and not agreed.nonfinite_loss:  # the loss scale found its level
            log.info(f"step {self.run.step}: fp16 gradients overflowed; update skipped, loss scale lowered to "
                     f"{loss_scale(engine).get('loss_scale', '?')}")
            bad = False
        else:
            bad = agreed.nonfinite_loss or skipped
        self.count = self.count + 1 if bad else 0
        if bad:
            log.warn(f"step {self.run.step}: non-finite loss or gradient norm; "
                     + ("DeepSpeed skipped this update" if skipped else
                        f"DeepSpeed applied this update ({self.precision} without an overflow check), so the weights "
                        "are no longer finite"))
        return bad, bad and (self.count >= self.run.cfg.optim.max_bad_steps or not skipped)


class SaveSchedule:
    """When to save: every --checkpoint_freq steps, when --checkpoint_minutes have passed on rank 0's clock, at the
    last step and on a stop. A periodic save that falls on a skipped update waits for the next good step."""

    def __init__(self, run: Run):
        self.run, self.last, self.deferred = run, time.monotonic(), False

    def clock_says_save(self) -> bool:
        cfg = self.run.cfg
        return (self.run.dist.is_main and cfg.checkpoint.checkpoint_minutes > 0
                and time.monotonic() - self.last >= 60 * cfg.checkpoint.checkpoint_minutes)

    def due(self, agreed: StepFlags, bad: bool) -> bool:
        cfg, step = self.run.cfg, self.run.step
        periodic = self.deferred or agreed.save_due or bool(cfg.checkpoint.checkpoint_freq and step % cfg.checkpoint.checkpoint_freq == 0)
        self.deferred = False
        if bad and periodic and not agreed.stop and step < cfg.batch.max_steps:  # all ranks agree on `bad`
            self.run.log.info(f"checkpoint: not saved at step {step}, whose update was skipped; the next good step "
                              "saves")
            periodic, self.deferred = False, True
        return agreed.stop or periodic or step == cfg.batch.max_steps

    def save(self, wait: bool) -> None:
        save(self.run, wait=wait)
        self.last = time.monotonic()


class DataTrace:
    """--trace_data: every rank appends the block indices it read each step to CHECKPOINT_DIR/data_trace."""

    def __init__(self, run: Run):
        self.file = None
        if run.cfg.logging.trace_data:
            folder = run.run_dir.data_trace
            folder.mkdir(parents=True, exist_ok=True)
            self.file = open(folder / f"rank-{run.dist.rank:05d}.jsonl", "a", encoding="utf-8")

    def write(self, step: int, blocks: list) -> None:
        if self.file is not None:
            self.file.write(json.dumps({"step": step, "blocks": blocks}) + "\n")
            self.file.flush()


def loss_scale(engine) -> dict:
    """fp16's current loss scale, for the log ({} in bf16 and fp32)."""
    if not engine.fp16_enabled():
        return {}
    scale = getattr(engine.optimizer, "loss_scale", None)
    return {"loss_scale": float(scale)} if isinstance(scale, (int, float)) else {}


def format_record(r: dict) -> str:
    parts = [f"step {r['step']}", f"loss {r['loss']:.4f}", f"lr {r['lr']:.3e}"]
    if r.get("grad_norm") is not None:
        parts.append(f"grad_norm {r['grad_norm']:.3f}")
    if r.get("loss_scale") is not None:
        parts.append(f"loss_scale {r['loss_scale']:g}")
    if r.get("skipped_steps"):
        parts.append(f"skipped {r['skipped_steps']}")
    parts.append(f"tokens/s {r['tokens_per_s']:,.0f}")
    if "mfu" in r:
        parts.append(f"TFLOP/s/gpu {r['tflops_per_device']:.1f} MFU {100 * r['mfu']:.1f}%")
    if r.get("step_time_s") is not None:
        parts.append(f"step {r['step_time_s']:.3f}s")
    if "peak_mem_gib" in r:
        parts.append(f"peak_mem {r['peak_mem_gib']:.1f}GiB")
    return " | ".join(parts)


def finish(run: Run):
    """Final evaluation, export to a Hugging Face directory, optional generation sample."""
    from .checkpoint import export_hf
    from .ds_config import zero_stage
    from .monitor import write_summary
    from .patches.deepspeed_offload import settle

    settle(run.engine)  # the evaluation and the export see every step's update (--delayed_update_from_step)
    log_evaluation(run, "eval (final)")
    if run.cfg.checkpoint.export:
        if run.examples:  # the export is prompted through the template its chats were rendered with
            from .sft_data import attach_chat_template
            attach_chat_template(run.tokenizer)
        if run.lora:
            out = export_adapters(run)
        else:
            out = export_hf(run.engine, run.model, run.tokenizer, run.run_dir.export, zero_stage(run.ds_config),
                            run.dist, run.log.info)
        if run.cfg.logging.generate_prompt and run.dist.is_main and out is not None:
            from .generate import generate_text
            run.log.info(f"sample: {generate_text(out, run.cfg.logging.generate_prompt)}")
    write_summary(run, "completed", export=str(run.run_dir.export) if run.cfg.checkpoint.export else None)


def export_adapters(run: Run):
    """A LoRA run's export on rank 0: the adapter in PEFT's format in EXPORT_DIR/adapter and, with --export_merged,
    the merged model in EXPORT_DIR/merged. ZeRO-1/2 hold the whole model on every rank; under ZeRO-3 every rank takes
    part in gathering it (checkpoint.gathered_state_dict) into a copy that rank 0 wraps again and exports. Returns the
    directory a plain transformers model loads from (the merged one), else None."""
    from .checkpoint import gathered_state_dict
    from .ds_config import zero_stage
    from .lora import export_lora

    module, merged = run.engine.module, run.cfg.checkpoint.export_merged
    state = gathered_state_dict(module, run.dist) if zero_stage(run.ds_config) == 3 else None
    written = None
    if run.dist.is_main:
        if state is not None:
            module = unpartitioned_copy(module.config, run.lora, state)
        written = export_lora(module, run.tokenizer, run.run_dir.export, merged=merged, in_place=state is not None)
        run.log.info("export: " + "; ".join(f"{kind} written to {path}" for kind, path in written.items()))
    run.dist.barrier()
    return written.get("merged") if written else None


def unpartitioned_copy(config, settings, state_dict: dict):
    """A LoRA model of `config` on the CPU holding `state_dict` (a gathered ZeRO-3 model's, adapters included)."""
    import torch
    from transformers import AutoModelForCausalLM

    from .lora import apply_lora

    model = apply_lora(AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=torch.float32), settings)
    missing, unexpected = model.load_state_dict(state_dict, strict=False)
    if unexpected or [k for k in missing if "lm_head" not in k]:
        raise RuntimeError(f"the gathered model does not match its LoRA wrapping: missing {missing[:3]}, unexpected "
                           f"{unexpected[:3]}")
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    return model
