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
import math
import os
import shutil
import socket
import time
from pathlib import Path

from model_utils.checkpoint.protocol import (data_position_problems, list_checkpoints, needs_universal,
                                             sequence_parallel_of, universal_command)
from model_utils.config import deepspeed as dsc
from model_utils.config.batch import BATCH_SETTINGS, Batch, BatchRequest, settle_batch, with_batch
from model_utils.config.checks import validate_args
from model_utils.config.deepspeed import resolve_settings
from model_utils.config.known_keys import check_known_keys
from model_utils.config.preference import preference_resume_problems, preference_settings
from model_utils.config.settings import LoraSettings, TrainConfig
from model_utils.config.stages import read_stages
from model_utils.core.problems import ConfigError, Problem
from model_utils.core.run_dir import CHECKPOINT_NAME
from model_utils.models.build import check_vocab_covers_tokenizer, masks_documents_by_position
from model_utils.models.lora import lora_resume_problems
from model_utils.models.memory import GIB, choose_micro_batch
from model_utils.models.quantization import prequantized_problems
from model_utils.models.speed import fused_kernels_problem
from model_utils.patches.deepspeed_checkpoint import converts_sequence_parallel
from model_utils.planning.memory_checks import (check_host_memory, check_memory, estimate_offload_update,
                                                note_faster_zero3_setup, note_long_sequences, note_offload_accumulation,
                                                note_parameter_fetches, note_parameters_fit_on_the_gpu,
                                                note_quantized_base)
from model_utils.planning.custom import check_custom_plan
from model_utils.planning.plan import Plan, make_plan
from model_utils.planning.report import Report
from model_utils.planning.stages import stage_problems
from model_utils.runtime.build_locks import stale_build_lock_problems


def planned_world_size() -> int:
    """What the run will have: the launchers export WORLD_SIZE (nodes x GPUs per node) for the preflight."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def run_preflight(cfg: TrainConfig, world_size: int | None = None, check_data: bool = True) -> Report:
    """`--preflight`: plan the run as its start would, on this machine, then check and print the plan."""
    missing = [name for name in ("torch", "deepspeed", "transformers") if importlib.util.find_spec(name) is None]
    if missing:
        return config_only_preflight(cfg, world_size or planned_world_size(), missing)

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
    report = check_plan(plan, check_data=False, measure_disk=dist.is_main)
    report.problems = merge_rank_problems(dist.all_gather_object((socket.gethostname(), report.problems)))
    raise_on_problems(report)
    for note in report.notes:
        log.warn(note)
    for line in report.estimates:  # memory and checkpoint disk; the run logs its config, batch and model lines
        log.info(line)
    resume, source, data_format = dist.broadcast_object((plan.resume, plan.data_source, plan.data_format))
    return dataclasses.replace(plan, resume=resume, data_source=source, data_format=data_format)


def check_plan(plan: Plan, check_data: bool = True, check_disk: bool = True, measure_disk: bool = True) -> Report:
    """Every check of a plan, and the lines that describe it. Nothing here is built or resolved: the run builds from the
    same plan. `check_data` False leaves the data to the run (which checks it while tokenizing); `check_disk` False is
    for a caller that never saves (the benchmark), whose checkpoint directory needs no room; `measure_disk` False
    skips the write-rate probe (a run's ranks but the first: one probe per job on the shared filesystem)."""
    import torch

    from model_utils.planning.data_checks import check_plan_data  # numpy, datasets: loaded here, not at --help

    cfg, mconf, seq_len = plan.cfg, plan.model.config if plan.model else None, plan.seq_len
    report = Report(plan, problems=list(plan.problems), notes=list(plan.notes))
    if mconf is not None:
        p = check_vocab_covers_tokenizer(mconf, plan.tokenizer, cfg.model.model, cfg.model.tokenizer)
        if p:
            report.problems.append(p)
        max_pos = getattr(mconf, "max_position_embeddings", None)
        if max_pos and plan.sequence_tokens > max_pos:
            # the factor counts from the model's own positions, also where --rope_scaling scaled them already
            own = ((getattr(mconf, "rope_parameters", None) or {}).get("original_max_position_embeddings")
                   if cfg.model.rope_scaling else None) or max_pos
            scaled = f" with --rope_scaling {cfg.model.rope_scaling}" if cfg.model.rope_scaling else ""
            report.problems.append(Problem("--seq_len", plan.sequence_tokens, f"exceeds the model's "
                                           f"max_position_embeddings ({max_pos}{scaled})", f"use --seq_len {max_pos} "
                                           "or less, or scale its rotary embeddings: --rope_scaling "
                                           f"yarn:{math.ceil(plan.sequence_tokens / own)}"))
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
    if ds is not None and mconf is not None:  # a model stored quantized, or a 4-bit base's settings against the run's
        whole = plan.model.vision.config if plan.model.vision is not None else mconf  # a VLM's: not its text config's
        report.problems += prequantized_problems(whole, cfg.model.model, cfg.model.load_in_4bit, dsc.precision(ds),
                                                 dsc.zero_stage(ds))
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
        if not cfg.curriculum.stages:  # else the stages' lines below state the length
            report.lines.append(f"plan: {batch.plan(cfg.batch.max_steps, streamed=cfg.data.streaming)}"
                                if cfg.batch.num_epochs is None else
                                f"plan: {cfg.batch.num_epochs:g} epochs (steps from the packed data)")
        if plan.fine_tuning is not None:
            report.lines.append(plan.fine_tuning.describe())
        report.lines += stage_lines(cfg)
        report.problems += stage_problems(plan)
    if plan.memory is not None and plan.model.custom is not None:  # a model of your own: its plan, checks, data
        check_custom_plan(plan, report, check_data and ds is not None)
        if check_disk:
            _check_checkpoint_dir(cfg, plan.checkpoints.bytes, report, measure_disk)
        report.estimate(f"checkpoint writes: {plan.checkpoints.description}")
    elif plan.memory is not None:
        check_memory(plan, report)
        note_quantized_base(plan, report)
        note_offload_accumulation(plan, report)
        note_parameter_fetches(plan, report)
        note_parameters_fit_on_the_gpu(plan, report)
        note_faster_zero3_setup(plan, report)
        estimate_offload_update(plan, report)
        check_host_memory(plan, report)
        note_long_sequences(plan, report)
        if check_disk:
            _check_checkpoint_dir(cfg, plan.checkpoints.bytes, report, measure_disk)
        report.estimate(f"checkpoint writes: {plan.checkpoints.description}")
    if ds is not None and check_data and plan.data_format != "custom":
        check_plan_data(plan, report)
    _check_resume(plan, report)
    return report


def stage_lines(cfg: TrainConfig) -> list[str]:
    """The curriculum's stages as the run will take them (a stage in epochs: its steps follow from its data)."""
    stages, _ = read_stages(cfg.curriculum.stages)
    if not stages:
        return []
    known = all(stage.steps is not None for stage in stages)
    total = sum(stage.steps for stage in stages) if known else None
    lines = [f"stages: {len(stages)}, " + (f"{total} steps in all (the run's length)" if known else
                                           "the run's length the sum of theirs (epochs counted on their data)")]
    return lines + ["  " + stage.describe(stage.steps) if stage.steps is not None else
                    "  " + stage.describe(0).replace("0 steps", "steps from its data") for stage in stages]


def config_only_preflight(cfg: TrainConfig, world: int, missing: list[str]) -> Report:
    """The checks a machine without torch/DeepSpeed can make (a login node): the arguments, the DeepSpeed config's
    JSON, its "auto" values and batch arithmetic; the report says what was left unchecked."""
    report = Report()
    report.problems += validate_args(cfg)
    ds_path = cfg.optim.ds_config_path
    raw, problems = dsc.load_json(ds_path) if ds_path.is_file() else (None, [])
    report.problems += problems
    if raw is not None:
        ds, notes, problems = resolve(raw, cfg, world, "bf16", None, check_classes=False, seq_len=cfg.model.seq_len)
        report.notes += notes
        report.problems += problems
        if not any(p.setting.startswith(BATCH_SETTINGS) for p in problems):
            batch = Batch.of(ds, world, cfg.model.seq_len or 0)  # the block length needs the model: not known here
            report.lines.append("effective DeepSpeed config:\n" + json.dumps(ds, indent=2))
            report.lines.append(f"batch: micro {batch.micro} x grad_acc {batch.accumulation} x world {world} = "
                                f"{batch.blocks_per_step} blocks per step; {cfg.batch.max_steps} steps")
    report.notes.append(f"{', '.join(missing)} not installed here: checked the arguments and the DeepSpeed config's "
                        "JSON, batch and schedule; not checked: DeepSpeed key names, optimizer and scheduler "
                        "parameters, tokenizer, model, memory, data and checkpoints (pip install -e . here checks "
                        "them too; the run's own start checks them on the GPU nodes)")
    return report


def _check_checkpoint_dir(cfg: TrainConfig, ckpt_bytes: float, report: Report, measure_disk: bool = True):
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

    there = sum(c.complete for c in list_checkpoints(path))
    new = max(1, count - there)
    need = ckpt_bytes * new
    free = shutil.disk_usage(probe).free
    report.estimate(f"checkpoints: ~{ckpt_bytes / GIB:.2f} GiB each, {count} on disk at most"
                    + (f" ({there} there already)" if there else "") + f"; {free / GIB:,.0f} GiB free in {probe}")
    if periodic and measure_disk:
        _state_the_shortest_save_interval(cfg, ckpt_bytes, probe, report)
    if need > free:
        shortfall = f"{new} more checkpoint(s) need ~{need / GIB:.0f} GiB, {free / GIB:.0f} GiB are free"
        if periodic:
            report.problems.append(Problem("--keep_last_checkpoints", cfg.checkpoint.keep_last_checkpoints, shortfall,
                                           "free space, keep fewer checkpoints, or use another --checkpoint_dir"))
        else:  # the last step's checkpoint alone does not fit: keeping fewer would not help
            report.problems.append(Problem("--checkpoint_dir", cfg.checkpoint.checkpoint_dir, shortfall,
                                           "free space there or use another --checkpoint_dir"))


WRITE_PROBE_BYTES = 32 << 20


def disk_write_rate(directory: Path, nbytes: int = WRITE_PROBE_BYTES) -> float | None:
    """Bytes per second one process writes and fsyncs into `directory` (a probe file, removed), or None where it
    cannot write there."""
    probe = directory / f".dslm-write-probe-{os.getpid()}"
    data = os.urandom(nbytes)  # incompressible: a filesystem that compresses would flatter zeros
    try:
        start = time.perf_counter()
        with open(probe, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        return nbytes / max(time.perf_counter() - start, 1e-6)
    except OSError:
        return None
    finally:
        probe.unlink(missing_ok=True)


def _state_the_shortest_save_interval(cfg: TrainConfig, ckpt_bytes: float, directory: Path, report: Report):
    """A periodic save waits for the previous one's writes: the checkpoint's size over the filesystem's write rate is
    the shortest interval between saves that costs training nothing beyond the host copy."""
    rate = disk_write_rate(directory)
    if rate is None:
        return
    seconds = ckpt_bytes / rate
    report.estimate(f"checkpoint disk: {directory} takes {rate / 1e6:,.0f} MB/s from one writer (fsynced): a "
                    f"checkpoint is written in the background in up to ~{seconds:,.{1 if seconds < 10 else 0}f} s "
                    "(less where the ranks' writes add up), the shortest interval between saves that does not wait "
                    "for the previous one's writes")
    minutes = cfg.checkpoint.checkpoint_minutes
    if minutes and minutes * 60 < seconds:
        report.notes.append(f"--checkpoint_minutes {minutes:g} is shorter than a checkpoint's write here (~"
                            f"{seconds:,.0f} s): each save will wait for the previous one; save less often")


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
    from model_utils.data.streaming import stream_resume_problems  # numpy: loaded here, not at --help
    from model_utils.data.tokens import tokenizer_identity

    cfg, info = plan.cfg, plan.resume
    if cfg.checkpoint.resume == "never" and any(CHECKPOINT_NAME.match(p.name) for p in cfg.checkpoint.run_dir.root.glob("step-*")):
        report.problems.append(Problem("--resume", cfg.checkpoint.resume, f"{cfg.checkpoint.checkpoint_dir} already holds checkpoints",
                                       "choose another --checkpoint_dir or move them away (nothing is deleted for you)"))
    if info is None:
        return
    m = info.manifest
    report.lines.append(f"resume: from {info.path} (step {m['step']})")
    if plan.ds_config is not None and needs_universal(info, plan.ranks, dsc.zero_stage(plan.ds_config)):
        split = sequence_parallel_of(info)
        if split > 1 and not converts_sequence_parallel():  # (patches.deepspeed_checkpoint)
            report.problems.append(Problem(
                "--resume_from_checkpoint" if cfg.checkpoint.resume_from_checkpoint else "--checkpoint_dir",
                str(info.path), f"was saved by {m.get('world_size')} GPUs with --sequence_parallel {split} and this "
                f"run has {plan.ranks}: DeepSpeed's universal conversion (ds_to_universal) cannot read a "
                "sequence-parallel checkpoint",
                f"resume on {m.get('world_size')} GPUs (with any --sequence_parallel that divides them)"))
        else:
            report.notes.append(f"{info.path} was saved by {m.get('world_size')} ranks and this run has {plan.ranks}: "
                                f"it will be converted to a universal checkpoint ({' '.join(universal_command(info))}) "
                                "and loaded with load_universal")
    if m.get("model") not in (None, cfg.model.model):
        report.problems.append(Problem("--model", cfg.model.model, f"{info.path} holds a checkpoint of {m.get('model')}",
                                       f"use --model {m.get('model')}, or another --checkpoint_dir"))
    report.problems += lora_resume_refusals(m, info.path, cfg.model.lora_settings())
    report.problems += preference_resume_problems(m.get("preference"), preference_settings(cfg), str(info.path))
    if m.get("rope_scaling") != cfg.model.rope_scaling and "rope_scaling" in m:  # the positions the weights learnt
        report.problems.append(Problem("--rope_scaling", cfg.model.rope_scaling, f"{info.path} was trained with "
                                       f"--rope_scaling {m['rope_scaling']}", "resume with the same --rope_scaling "
                                       "(or none where it had none)"))
    # The data position counts blocks of the checkpoint's seq_len in its tokens: another block length or tokenizer
    # would continue at another place (the data themselves are compared when the run has read them).
    identity = {"seq_len": plan.seq_len, "tokenizer": cfg.model.tokenizer}
    if plan.tokenizer is not None:
        identity["tokenizer_identity"] = tokenizer_identity(plan.tokenizer)
    report.problems += data_position_problems(m, info.path, identity)
    report.problems += stream_resume_problems(m, info.path, cfg.data.streaming, cfg.data.stream_shuffle_blocks,
                                              plan.world)


def lora_resume_refusals(manifest: dict, path, settings) -> list[Problem]:
    """A checkpoint continues with the adapters it was trained with, and a full fine-tuning checkpoint without any."""
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


def resolve(raw: dict, cfg: TrainConfig, world_size: int, hardware: str, hidden_size: int | None = None,
            check_classes: bool = True, seq_len: int | None = None) -> tuple[dict, list[str], list[Problem]]:
    """The whole config resolved at once, with the default micro-batch where the batch asks for an automatic one (no
    memory estimate: a machine without the model, the tests). planning/plan.py composes the same steps with the
    automatic micro-batch its memory model chooses: `resolve_settings`, `BatchRequest.of`, `settle_batch`,
    `with_batch`."""
    ds, notes, problems = resolve_settings(raw, cfg, hardware, hidden_size, check_classes)
    request, notes_, problems_ = BatchRequest.of(raw, cfg.batch, world_size, seq_len)
    notes += notes_
    problems += problems_
    if request is not None:
        micro = request.micro or choose_micro_batch(seq_len or 1, None, None, request.divides)[0]
        batch, notes_, problems_ = settle_batch(request, micro, seq_len or 0)
        notes += notes_
        problems += problems_
        if batch is not None:
            return with_batch(ds, batch, notes, problems)
    return ds, notes, problems
