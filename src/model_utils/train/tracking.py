"""What the loop keeps between steps: the log interval's losses and times (its record), the count of consecutive
non-finite steps and the verdict on each, when a save is due, and the --trace_data files.
"""

from __future__ import annotations

import json
import time

import torch

from model_utils.config.deepspeed import precision
from model_utils.models.preference import METRICS as PAIR_METRICS
from model_utils.runtime.run_log import Throughput, memory_stats
from model_utils.train.preference import pair_record
from model_utils.train.run import Run
from model_utils.train.step import StepFlags, StepResult


class Interval:
    """The log interval on this rank: the losses, attention pairs and host step time summed over its steps; `log`
    turns them into the interval's record (two collectives, at log steps only) and starts the next interval."""

    def __init__(self, run: Run):
        self.run = run
        self.throughput = Throughput(run.peak_tflops, run.dist.world_size)
        self.loss_sum = torch.zeros((), device=run.dist.device, dtype=torch.float64)
        self.pair_sums = torch.zeros(1 + len(PAIR_METRICS), device=run.dist.device, dtype=torch.float64)
        self.steps, self.area, self.step_time, self.vision_flops = 0, 0, 0.0, 0.0

    def add(self, result: StepResult, seconds: float) -> None:
        self.loss_sum += result.loss_sum
        if result.pairs is not None:
            self.pair_sums += result.pairs
        self.area += result.attention_area
        self.vision_flops += result.vision_flops
        self.step_time += seconds
        self.steps += 1

    def log(self, lr: float) -> dict:
        run, dist, engine = self.run, self.run.dist, self.run.engine
        sums = torch.stack([self.loss_sum, torch.tensor(float(self.area), device=dist.device, dtype=torch.float64),
                            torch.tensor(self.vision_flops, device=dist.device, dtype=torch.float64)])
        loss_total, area_total, vision_total = dist.all_reduce(sums).tolist()
        mean_loss = loss_total / (self.steps * run.batch.accumulation * run.batch.world)  # data-parallel ranks
        tokens = self.steps * run.batch.tokens_per_step
        # slowest and fastest rank's mean step time (max of t and of -t: one collective)
        times = torch.tensor([self.step_time, -self.step_time], device=dist.device, dtype=torch.float64) / self.steps
        slowest, fastest = dist.all_reduce(times, torch.distributed.ReduceOp.MAX).tolist()
        grad_norm = engine.get_global_grad_norm()
        pairs = pair_record(dist.all_reduce(self.pair_sums).tolist()) if run.preference else {}
        record = {"step": run.step, "loss": mean_loss, **pairs, "lr": lr,
                  "grad_norm": float(grad_norm) if grad_norm is not None else None,
                  "skipped_steps": engine.skipped_steps, **loss_scale(engine), "tokens_seen": run.tokens_seen,
                  **self.throughput.read(tokens, run.flops.flops(tokens, area_total) + vision_total),
                  "step_time_s": slowest, "step_time_min_s": -fastest, **memory_stats(dist.device)}
        if run.custom is not None and "flops" not in run.custom.hooks:  # no FLOPs counted: no TFLOP/s, no MFU
            record.pop("tflops_per_device", None)
            record.pop("mfu", None)
        run.log.metrics(record)
        run.log.bar.set_postfix(loss=f"{mean_loss:.4f}", lr=f"{lr:.2e}", refresh=False)
        run.log.info(format_record(record))
        self.loss_sum.zero_()
        self.pair_sums.zero_()
        self.steps, self.area, self.step_time, self.vision_flops = 0, 0, 0.0, 0.0
        return record


class NonfiniteSteps:
    """Consecutive steps whose loss or gradient was not finite. What DeepSpeed did decides, not the config: it skips
    such an update where it checks for overflow (fp16's loss scaling, bf16's check_grad_overflow, on by default) and
    applies it otherwise (fp32). The run gives up after --max_bad_steps skipped in a row, or after one applied."""

    def __init__(self, run: Run):
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

    def saved(self) -> None:
        """A checkpoint was saved: --checkpoint_minutes count from now."""
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
    parts = [f"step {r['step']}", f"loss {r['loss']:.4f}"]
    parts += [f"{name} {r[name]:.{3 if name == 'rewards/accuracies' else 4}f}" for name in PAIR_METRICS if name in r]
    parts.append(f"lr {r['lr']:.3e}")
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
