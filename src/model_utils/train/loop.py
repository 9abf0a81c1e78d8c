"""The training loop, top to bottom: `train(run)` steps, logs, evaluates, agrees with the other ranks, judges the
update, saves or stops, and returns the exit status; `evaluate`, `save` and `finish` (the final evaluation, the
export, the sample) beside it. The run comes from build.build_run; its step from step.py, or from preference.py where
it tunes on preference pairs.
"""

from __future__ import annotations

import math
import sys
import time

import torch
from deepspeed.checkpoint.constants import (UNIVERSAL_CHECKPOINT_INFO, UNIVERSAL_CHECKPOINT_VERSION_KEY,
                                            UNIVERSAL_CHECKPOINT_VERSION_VALUE)
from tqdm import tqdm

from model_utils.checkpoint.save import SaveContext, save_checkpoint
from model_utils.config.deepspeed import precision, zero_stage
from model_utils.core.exit_status import NONFINITE, OK, STOPPED_BY_SIGNAL
from model_utils.data.sft.formats import attach_chat_template
from model_utils.data.streaming import with_stream_state
from model_utils.models.custom import contract as custom_model
from model_utils.models.custom.export import portable_spec, write_export
from model_utils.models.evaluation import evaluation_loss
from model_utils.models.export import export_hf, gathered_state_dict
from model_utils.models.generate import generate_text
from model_utils.models.lora import export_lora, export_qlora, unpartitioned_copy
from model_utils.models.quantization import merged_dtype, plain_tensor
from model_utils.patches.deepspeed_offload import settle
from model_utils.runtime.monitor import write_summary
from model_utils.runtime.process import StopSignal, rng_state
from model_utils.train.preference import describe_evaluation, preference_evaluation, preference_step
from model_utils.train.reference import reference_manifest
from model_utils.train.resume import checkpoint_options
from model_utils.train.run import Run
from model_utils.train.stages import enter_stage
from model_utils.train.step import agree_after_step, model_inputs, train_step
from model_utils.train.tracking import DataTrace, Interval, NonfiniteSteps, SaveSchedule

SAVE_WAIT_TOLD_S = 0.5  # a save that waits longer than this for the previous one's writes is told, with the fix


# ----------------------------------------------------------------------------------------------------------------------
# The loop
# ----------------------------------------------------------------------------------------------------------------------
def train(run: Run) -> int:
    """The loop: step, log, evaluate, agree, judge the update, save or stop. Returns the exit status."""
    cfg, log = run.cfg, run.log
    stop = StopSignal()
    interval, nonfinite, saves, trace = Interval(run), NonfiniteSteps(run), SaveSchedule(run), DataTrace(run)
    # A progress bar on a terminal only: in a job's log file its redraws would be lines of carriage returns, and the
    # log lines every --log_interval steps say the same.
    log.bar = tqdm(total=cfg.batch.max_steps, initial=run.step, desc="train", dynamic_ncols=True,
                   disable=not (run.dist.is_main and sys.stderr.isatty()))
    run.engine.train()
    while run.step < cfg.batch.max_steps:
        # --- one optimizer step at this learning rate (the saves' host memory allocated beside the first steps) ---
        if run.saves:
            run.saves.reserve_buffers(run.engine, checkpoint_options(run)[0])
        lr = max(run.engine.get_lr()) if run.stages else run.engine.get_lr()[0]  # a stage's frozen groups: 0
        t0 = time.perf_counter()
        result = preference_step(run) if run.preference else train_step(run)
        interval.add(result, time.perf_counter() - t0)
        trace.write(run.step, result.blocks)
        if run.offload:
            run.offload.tell_once(log)  # the host memory the first step's offloaded activations took

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

        # --- the end of a curriculum stage: evaluated, the next stage's data and rates in force, then saved ---
        boundary = run.stages is not None and run.stages.ends_at(run.step)
        if boundary:
            next_stage(run)

        # --- checkpoint, and stop when a signal asked for it (all ranks agree) ---
        if saves.due(agreed, bad) or boundary:
            save(run, wait=agreed.stop or run.step == cfg.batch.max_steps)
            saves.saved()
        if agreed.stop and run.step < cfg.batch.max_steps:
            log.info(f"stop: {stop.received or 'a signal on another rank'} received; checkpoint saved at step "
                     f"{run.step}; exiting with status {STOPPED_BY_SIGNAL} so the job can be requeued")
            return end_early(run, STOPPED_BY_SIGNAL, f"preempted: {stop.received or 'signal on another rank'} at "
                                                     f"step {run.step} (requeue resumes)")
    log.bar.close()
    log.bar = None
    finish(run)
    return OK


# ----------------------------------------------------------------------------------------------------------------------
# What the loop calls: evaluation, saves, the end of a run
# ----------------------------------------------------------------------------------------------------------------------
def next_stage(run: Run) -> None:
    """The stage that ends at this step evaluated; the next one's data in force (its learning rates and what it
    trains follow from the schedule at the next step)."""
    k = run.stages.index_at(run.step - 1)
    ended, following = run.stages.stages[k], run.stages.stages[k + 1]
    interval = run.cfg.logging.eval_interval
    if not (interval and run.step % interval == 0):  # else the periodic evaluation of this step was it
        log_evaluation(run, f"eval (end of stage {ended.name})")
    enter_stage(run, k + 1, fresh=run.stages.fresh_data(k + 1))
    run.log.info(f"stage {following.name}: from step {run.step + 1}"
                 + (", its data from their start" if run.stages.fresh_data(k + 1) else ", the same data continued"))
    run.log.metrics({"step": run.step, "stage": following.name})


def evaluate(run: Run) -> dict:
    settle(run.engine)  # the model with every step's update (--delayed_update_from_step)
    ids = run.data.val_ids
    if len(ids) == 0:
        return {}
    engine, dist, m = run.engine, run.dist, run.batch.micro
    engine.eval()
    sums = torch.zeros(2, device=dist.device, dtype=torch.float64)  # the loss summed over its targets, their count
    with torch.no_grad():
        for i in range(run.cfg.logging.eval_iters):
            start = (i * dist.data_world + dist.data_rank) * m  # a sequence-parallel group reads alike
            picks = [ids[(start + j) % len(ids)] for j in range(m)]
            inputs = model_inputs(run, run.data.val.batch(picks))
            summed, targets = (custom_model.evaluation_loss(engine, run.custom.spec, inputs) if run.custom is not None
                               else evaluation_loss(engine, run.model, inputs))
            sums += torch.stack([summed, targets])
    engine.train()
    loss_sum, targets = dist.all_reduce(sums).tolist()
    loss = loss_sum / max(targets, 1)
    return {"eval_loss": loss, "eval_ppl": math.exp(min(loss, 50.0))}


def log_evaluation(run: Run, label: str):
    result = preference_evaluation(run) if run.preference else evaluate(run)
    if result:
        run.log.metrics({"step": run.step, **result})
        run.log.info(f"{label} step {run.step}: " + (describe_evaluation(result) if run.preference else
                                                     f"loss {result['eval_loss']:.4f}, perplexity "
                                                     f"{result['eval_ppl']:.2f}"))


def save(run: Run, wait: bool = False):
    """Save a checkpoint of this step on every rank. In the background (run.saves), training goes on once the state
    is in host memory, after the checkpoint still in flight, if any, is complete; `wait` also finishes this one."""
    settle(run.engine)  # a checkpoint holds every step's update; the run resumed from it continues the same way

    ctx = SaveContext(run.run_dir.root, run.cfg.checkpoint.keep_last_checkpoints,
                      {"model": run.cfg.model.model, **run.data_identity, "zero_stage": zero_stage(run.ds_config),
                       "ds_config": run.ds_config, "perf": run.cfg.speed.as_dict(),
                       "rope_scaling": run.cfg.model.rope_scaling,
                       **(own_model_manifest(run) if run.custom is not None else {}),
                       "levers_in_force": run.speed_in_force,
                       "lora": run.lora.as_manifest() if run.lora else None,
                       "preference": run.preference.as_manifest() if run.preference else None,
                       "reference": reference_manifest(run)},
                      save_options=checkpoint_options(run)[0])
    client = {"step": run.step, "tokens_seen": run.tokens_seen, "data_position": run.position.state_dict(),
              "stage": run.stages.stages[run.stages.index_at(run.step)].name if run.stages else None,
              # lets `ds_to_universal` convert the checkpoint for another world size (data parallelism only)
              UNIVERSAL_CHECKPOINT_INFO: {UNIVERSAL_CHECKPOINT_VERSION_KEY: UNIVERSAL_CHECKPOINT_VERSION_VALUE}}
    rank_state = with_stream_state(rng_state(), run.data)  # each rank's file: its RNG, its place in a stream
    t0 = time.perf_counter()
    if run.saves is None:
        save_checkpoint(run.engine, ctx, run.step, client, rank_state, run.dist, run.log.info)
    else:
        in_flight = run.saves.pending
        run.saves.finish()  # one checkpoint in flight at a time
        waited = time.perf_counter() - t0
        if in_flight is not None and waited >= SAVE_WAIT_TOLD_S:
            run.log.warn(f"checkpoint: step {run.step} waited {waited:.1f}s for step {in_flight.step}'s writes (they "
                         f"took {run.saves.last_write_s:.1f}s, longer than the interval between the saves): save "
                         "less often (--checkpoint_freq, --checkpoint_minutes) or to a faster filesystem")
        run.saves.started(save_checkpoint(run.engine, ctx, run.step, client, rank_state, run.dist, run.log.info,
                                          run.saves.writer))
        run.log.info(f"checkpoint: step {run.step} in host memory after {time.perf_counter() - t0:.1f}s"
                     + ("; waiting for its writes (the last step, or a stop)" if wait else
                        "; writing it in the background"))
        run.log.metrics({"step": run.step, "checkpoint_wait_s": waited,  # and the host memory no reservation held
                         "checkpoint_unreserved_host_gib": run.saves.writer.buffers.fresh_bytes / 2**30})
        if wait:
            run.saves.finish()
    run.log.metrics({"step": run.step, "checkpoint_s": time.perf_counter() - t0})  # how long training stood still


def own_model_manifest(run: Run) -> dict:
    """What `python -m model_utils.export` needs to build a model of your own again: its function (the path made
    absolute), model_args, seq_len and seed."""
    return {"model_file": portable_spec(run.custom.spec), "model_args": run.custom.settings.args,
            "model_seq_len": run.custom.settings.seq_len, "seed": run.custom.settings.seed}


def end_early(run: Run, status: int, why: str) -> int:
    """Every early exit of the loop: the progress bar closed, a checkpoint in flight completed (it was saved at a
    good step), the summary written with the exit status."""
    run.log.bar.close()
    if run.saves:
        run.saves.finish()
    write_summary(run, f"{why}, exit {status}")
    return status


def finish(run: Run):
    """Final evaluation, export to a Hugging Face directory, optional generation sample."""
    settle(run.engine)  # the evaluation and the export see every step's update (--delayed_update_from_step)
    log_evaluation(run, "eval (final)")
    if run.cfg.checkpoint.export:
        if run.examples:  # the export is prompted through the template its chats were rendered with
            attach_chat_template(run.tokenizer)
        if run.lora:
            out = export_adapters(run)
        elif run.custom is not None:
            out = export_own_model(run)
        else:
            out = export_hf(run.engine, run.model, run.tokenizer, run.run_dir.export, zero_stage(run.ds_config),
                            run.dist, run.log.info)
            if run.vision is not None and run.dist.is_main:  # the image processor and template beside the model
                run.vision.processor.save_pretrained(out)
        if run.cfg.logging.generate_prompt and run.dist.is_main and out is not None:
            run.log.info(f"sample: {generate_text(out, run.cfg.logging.generate_prompt)}")
    write_summary(run, "completed", export=str(run.run_dir.export) if run.cfg.checkpoint.export else None)


def export_own_model(run: Run):
    """A model of your own's export (models.custom.export): save_pretrained where it is a transformers model, else its
    weights and how to build it. Every rank takes part in gathering ZeRO-3's partitions; rank 0 writes."""
    from transformers import PreTrainedModel

    if isinstance(run.model, PreTrainedModel):
        return export_hf(run.engine, run.model, run.tokenizer, run.run_dir.export, zero_stage(run.ds_config),
                         run.dist, run.log.info)
    state = gathered_state_dict(run.model, run.dist) if zero_stage(run.ds_config) == 3 else (
        run.model.state_dict() if run.dist.is_main else None)
    if run.dist.is_main:
        out = write_export(run.run_dir.export, state, run.custom.spec, run.custom.settings)
        run.log.info(f"export: your model's weights and how to build it written to {out} "
                     "(models.custom.export.load_exported loads it)")
    run.dist.barrier()
    return None


def export_adapters(run: Run):
    """A LoRA run's export on rank 0: the adapter in PEFT's format in EXPORT_DIR/adapter and, with --export_merged,
    the merged model in EXPORT_DIR/merged. ZeRO-1/2 hold the whole model on every rank; under ZeRO-3 every rank takes
    part in gathering it (models.export.gathered_state_dict) into a copy that rank 0 wraps again and exports. Returns
    the directory a plain transformers model loads from (the merged one), else None."""
    module, merged, out = run.engine.module, run.cfg.checkpoint.export_merged, run.run_dir.export
    written = None
    if run.lora.load_in_4bit:  # QLoRA: the base dequantized into a 16-bit copy on rank 0 (models.lora.export_qlora)
        dtype = merged_dtype(precision(run.ds_config))
        state = gathered_state_dict(module, run.dist, lambda tensor: plain_tensor(tensor, dtype))
        if run.dist.is_main:
            written = export_qlora(module, state, run.tokenizer, out, merged)
    else:
        state = gathered_state_dict(module, run.dist) if zero_stage(run.ds_config) == 3 else None
        if run.dist.is_main:
            if state is not None:
                module = unpartitioned_copy(module.config, run.lora, state)
            written = export_lora(module, run.tokenizer, out, merged=merged, in_place=state is not None)
    if written:
        if run.vision is not None:
            for path in written.values():
                run.vision.processor.save_pretrained(path)
        run.log.info("export: " + "; ".join(f"{kind} written to {path}" for kind, path in written.items()))
    run.dist.barrier()
    return written.get("merged") if written else None
