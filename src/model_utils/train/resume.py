"""A checkpoint loaded into a built run: the engine's state, the step, the data position and each rank's RNG state; and
what differs from the checkpoint's run (speed options that change the numerics, the optimisation) said, not hidden.
"""

from __future__ import annotations

import torch

from model_utils.checkpoint.protocol import rng_state_file, world_size_changed
from model_utils.config.deepspeed import optimisation_changes
from model_utils.config.preference import resume_changes
from model_utils.data.blocks import DataPosition
from model_utils.data.streaming import resume_stream
from model_utils.models.lora import checkpoint_options as lora_options
from model_utils.runtime.process import set_rng_state
from model_utils.train.run import Run


def load_checkpoint(run: Run, info, tag: str):
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
    changed = resume_changes((info.manifest or {}).get("preference"), run.preference)
    if changed:
        run.log.warn(f"resume: the objective's values differ from the checkpoint's run ({'; '.join(changed)}): the "
                     "run continues with this run's values")
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
    weights out (models.lora.checkpoint_options), which the resumed run has from the pretrained model."""
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
