"""Seeing a run: the log header, metric sinks (TensorBoard, Weights & Biases) and the end-of-run summary.

Every metric record goes to CHECKPOINT_DIR/metrics.jsonl (`Logger.metrics`) and, through `Sinks`, to TensorBoard
(CHECKPOINT_DIR/tensorboard) and W&B when enabled. Only rank 0 writes. docs/MONITORING.md defines every metric.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import secrets
import shlex
import socket
import string
import sys
import time
import warnings
from pathlib import Path

from model_utils.checkpoint.protocol import read_latest
from model_utils.config import run_file
from model_utils.core.run_dir import METRICS, SUMMARY, TENSORBOARD, RunDir
from model_utils.patches.registry import versions_line

# metrics.jsonl key -> TensorBoard / W&B tag
TAGS = {
    "loss": "train/loss", "lr": "train/lr", "grad_norm": "train/grad_norm", "tokens_seen": "train/tokens_seen",
    "skipped_steps": "train/skipped_steps", "loss_scale": "train/loss_scale",
    "tokens_per_s": "perf/tokens_per_s", "tokens_per_s_per_device": "perf/tokens_per_s_per_device",
    "tflops_per_device": "perf/tflops_per_device", "mfu": "perf/mfu",
    "step_time_s": "perf/step_time_s", "step_time_min_s": "perf/step_time_min_s",
    "mem_gib": "memory/mem_gib", "peak_mem_gib": "memory/peak_mem_gib",
    "host_mem_gib": "memory/host_mem_gib", "host_peak_mem_gib": "memory/host_peak_mem_gib",
    "eval_loss": "eval/loss", "eval_ppl": "eval/ppl", "checkpoint_s": "checkpoint/save_s",
    "checkpoint_wait_s": "checkpoint/wait_s", "checkpoint_write_s": "checkpoint/write_s",
    # preference tuning: TRL's names of what each step and evaluation logs
    **{f"{prefix}{kind}/{what}": f"{tier}/{kind}/{what}" for prefix, tier in (("", "train"), ("eval_", "eval"))
       for kind, whats in (("rewards", ("chosen", "rejected", "accuracies", "margins")),
                           ("logps", ("chosen", "rejected"))) for what in whats},
}
PAIR_METRIC_KINDS = ("rewards/", "logps/")


# ----------------------------------------------------------------------------------------------------------------------
# Header: who, where, with what (SLURM style: job id, nodes, world size, versions, effective configuration)
# ----------------------------------------------------------------------------------------------------------------------
def package_version(dist_name: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(dist_name)
    except metadata.PackageNotFoundError:
        return "not installed"


def environment(dist) -> dict:
    """Job, nodes, world and versions, as a flat dict (also stored in summary.json)."""
    import torch

    env = os.environ
    info = {
        "job_id": env.get("SLURM_JOB_ID"),
        "array": (f"{env['SLURM_ARRAY_JOB_ID']}_{env.get('SLURM_ARRAY_TASK_ID', '')}"
                  if "SLURM_ARRAY_JOB_ID" in env else None),
        "restart_count": int(env.get("SLURM_RESTART_COUNT", "0") or 0) if "SLURM_JOB_ID" in env else None,
        "job_name": env.get("SLURM_JOB_NAME"),
        "nodelist": env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST"),
        "nnodes": int(env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES") or 1),
        "host": socket.gethostname(),
        "world_size": dist.world_size,
        "backend": dist.backend,
        "device": dist.device.type,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "deepspeed": package_version("deepspeed"),
        "transformers": package_version("transformers"),
        "cuda": torch.version.cuda,
        "nccl": None,
        "gpu": None,
    }
    if torch.cuda.is_available():
        try:
            info["nccl"] = ".".join(str(v) for v in torch.cuda.nccl.version())
        except Exception:  # noqa: BLE001 (builds without NCCL)
            pass
        info["gpu"] = f"{torch.cuda.get_device_name(dist.device)} x {torch.cuda.device_count()} per node"
    return info


def header_lines(cfg, dist) -> list[str]:
    e = environment(dist)
    if e["job_id"]:
        job = f"SLURM job {e['job_id']}" + (f" (array {e['array']})" if e["array"] else "")
        job += f" '{e['job_name']}'" if e["job_name"] else ""
        job += f", restart {e['restart_count']}" if e["restart_count"] else ""
        where = f"nodes {e['nodelist']} ({e['nnodes']}), rank 0 on {e['host']}"
    else:
        job, where = "no SLURM job", f"host {e['host']}"
    flags = cfg.flags()
    return [
        "=" * 100,
        f"run: {job}; {where}; world size {e['world_size']} ({e['backend']}, {e['device']})",
        f"versions: python {e['python']}, torch {e['torch']}, deepspeed {e['deepspeed']}, transformers "
        f"{e['transformers']}, CUDA {e['cuda'] or 'none'}, NCCL {e['nccl'] or 'none'}"
        + (f"; GPU {e['gpu']}" if e["gpu"] else ""),
        versions_line(),
        f"command: {command_line()}",
        f"config (effective flags): {json.dumps(flags, default=str)}",
        "=" * 100,
    ]


def command_line() -> str:
    return shlex.join([Path(sys.argv[0]).name, *sys.argv[1:]])


def start_run_log(log, cfg, dist):
    """Print the header (rank 0) and keep other ranks' library output from repeating rank 0's."""
    log.start_time = time.time()
    quiet_other_ranks(dist)
    for line in header_lines(cfg, dist):
        log.info(line)


def write_run_config(log, cfg):
    """CHECKPOINT_DIR/config.yaml: every flag's value, a file the next run takes with --config (config/run_file.py).
    Rank 0, once the run is built (train_deepspeed.main): a run refused before it starts leaves the file as it was."""
    try:
        path = run_file.write(cfg, command_line())
    except OSError as error:  # a full or read-only disk: the header's config line holds the same flags
        log.warn(f"{cfg.checkpoint.run_dir.config} could not be written ({error.strerror or error}); the header's "
                 "config line above holds the same flags")
    else:
        log.info(f"config file: {path} (every flag's value; --config {path} runs the same again)")


def quiet_other_ranks(dist):
    """Ranks > 0: DeepSpeed's log only at ERROR (rank 0 prints the same lines), deprecation notices dropped (the same
    on every rank), other Python warnings prefixed with the rank."""
    if dist.is_main:
        return
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    show = warnings.showwarning

    def prefixed(message, category, filename, lineno, file=None, line=None):
        show(f"[rank {dist.rank}] {message}", category, filename, lineno, file, line)

    warnings.showwarning = prefixed


def describe_ds_config(ds: dict) -> str:
    return f"config (DeepSpeed, resolved): {json.dumps(ds, default=str)}"


# ----------------------------------------------------------------------------------------------------------------------
# Sinks: TensorBoard and W&B (metrics.jsonl is written by Logger itself)
# ----------------------------------------------------------------------------------------------------------------------
def tensorboard_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("tensorboard") is not None


def prepare_ds_monitor(ds: dict, run_dir: RunDir) -> None:
    """DeepSpeed's own monitor (``"tensorboard": {"enabled": true}`` in ds_config) writes into
    CHECKPOINT_DIR/tensorboard unless the config names another place (DeepSpeed's default would be
    ./DeepSpeedJobName)."""
    tb = ds.get("tensorboard")
    if isinstance(tb, dict) and tb.get("enabled") and not tb.get("output_path"):
        tb["output_path"] = str(run_dir.root)
        tb.setdefault("job_name", TENSORBOARD)
    csv = ds.get("csv_monitor")
    if isinstance(csv, dict) and csv.get("enabled") and not csv.get("output_path"):
        csv["output_path"] = str(run_dir.root)
        csv.setdefault("job_name", "csv_monitor")


def _ds_enabled(ds: dict, key: str) -> bool:
    section = ds.get(key)
    return isinstance(section, dict) and bool(section.get("enabled"))


class Sinks:
    """Rank 0 forwards each metrics record to TensorBoard and W&B; other ranks hold nothing and do nothing."""

    def __init__(self, cfg, run_dir: RunDir, dist, ds: dict, engine=None, start_step: int = 0, log=None):
        self.tb = None
        self.wandb = None
        self.ds_monitor = None
        self.paths: dict[str, str] = {}
        if not dist.is_main:
            return
        info = log.info if log else print
        warn = log.warn if log else print
        ds_monitor = getattr(engine, "monitor", None)
        if ds_monitor is not None and getattr(ds_monitor, "enabled", False):
            # DeepSpeed's MonitorMaster fans records out to the sinks enabled in ds_config; those are not doubled here.
            self.ds_monitor = ds_monitor
            enabled = [k for k in ("tensorboard", "wandb", "csv_monitor", "comet") if _ds_enabled(ds, k)]
            info(f"metrics: also through DeepSpeed's monitor ({', '.join(enabled)}, from the DeepSpeed config)")
            if _ds_enabled(ds, "tensorboard"):
                tb = ds["tensorboard"]
                self.paths["tensorboard"] = str(Path(tb.get("output_path") or ".") / tb.get("job_name", "DeepSpeedJobName"))
        if cfg.logging.tensorboard and not _ds_enabled(ds, "tensorboard"):
            if not tensorboard_available():
                warn("tensorboard is not installed: metrics go to metrics.jsonl only (pip install tensorboard, or "
                     "the project's `monitor` extra; --no-tensorboard silences this)")
            else:
                from torch.utils.tensorboard import SummaryWriter

                log_dir = run_dir.tensorboard
                # purge_step: a resumed run drops the events a killed run wrote after the checkpoint it resumes from
                self.tb = SummaryWriter(log_dir=str(log_dir), purge_step=start_step + 1 if start_step else None,
                                        flush_secs=30)
                self.paths["tensorboard"] = str(log_dir)
        if cfg.logging.wandb and not _ds_enabled(ds, "wandb"):
            # Only rank 0 gets here: a failure must not stop it while the other ranks wait in the first collective.
            try:
                self.wandb = _start_wandb(cfg, ds, run_dir)
            except Exception as e:  # noqa: BLE001 (network, login, version problems)
                warn(f"W&B logging is off for this run: {type(e).__name__}: {e} (WANDB_MODE=offline needs no network)")
            else:
                self.paths["wandb"] = f"{self.wandb.project}/{self.wandb.id}" + (
                    " (offline: `wandb sync` uploads it)" if self.wandb.settings.mode == "offline" else "")
        if self.paths:
            info("metrics: " + "; ".join(f"{k} {v}" for k, v in self.paths.items()) + f"; jsonl {run_dir.metrics}")

    def write(self, record: dict):
        step = record.get("step")
        if step is None:
            return
        values = {TAGS.get(k, k): float(v) for k, v in record.items()
                  if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}
        if self.tb is not None:
            for tag, value in values.items():
                self.tb.add_scalar(tag, value, step)
            if "eval/loss" in values:
                self.tb.flush()
        if self.wandb is not None:
            self.wandb.log(values, step=step)
        if self.ds_monitor is not None:
            self.ds_monitor.write_events([(tag, value, step) for tag, value in values.items()])

    def close(self):
        if self.tb is not None:
            self.tb.close()
            self.tb = None
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None


def wandb_missing_message() -> str:
    return ("--wandb needs the wandb package, which is not installed: pip install wandb (or the project's `monitor` "
            "extra); WANDB_MODE=offline logs without network")


def _start_wandb(cfg, ds: dict, run_dir: RunDir):
    try:
        import wandb
    except ImportError as e:  # validate_args refuses --wandb without the package; this is the safety net
        raise RuntimeError(wandb_missing_message()) from e
    ckpt = run_dir.root
    ckpt.mkdir(parents=True, exist_ok=True)
    id_file = run_dir.wandb_run_id
    run_id = id_file.read_text().strip() if id_file.exists() else "".join(
        secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))
    id_file.write_text(run_id)  # a resumed run (same checkpoint dir) continues the same W&B run
    name = os.environ.get("WANDB_NAME") or (f"{ckpt.name}-{os.environ['SLURM_JOB_ID']}"
                                            if "SLURM_JOB_ID" in os.environ else ckpt.name)
    flags = cfg.flags()
    return wandb.init(project=cfg.logging.wandb_project or os.environ.get("WANDB_PROJECT") or "deepspeed-lm", name=name,
                      id=run_id, resume="allow", dir=str(ckpt), config={**flags, "deepspeed": ds})


# ----------------------------------------------------------------------------------------------------------------------
# Summary: a short table at the end of the run (and on preemption), and summary.json
# ----------------------------------------------------------------------------------------------------------------------
def read_metrics(path) -> tuple[list[dict], list[dict]]:
    """(train records, eval records) of a metrics.jsonl, the last record of each step winning (a resumed run rewrites
    the steps after its checkpoint)."""
    train, evals = {}, {}
    path = Path(path)
    if path.is_dir():
        path = path / METRICS
    if not path.exists():
        return [], []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by kill -9
        if "loss" in r:
            train[r["step"]] = r
        elif "eval_loss" in r:
            evals[r["step"]] = r
    return [train[s] for s in sorted(train)], [evals[s] for s in sorted(evals)]


def _save_stalls(metrics_path) -> dict:
    """How many checkpoints were saved and how long training stood still for them (the `checkpoint_s` records), of
    which how long it waited for a previous checkpoint's writes (`checkpoint_wait_s`), and how long the background
    writes took (`checkpoint_write_s`, from the save's start to the checkpoint complete)."""
    path = Path(metrics_path)
    path = path / METRICS if path.is_dir() else path
    found = {"checkpoint_s": [], "checkpoint_wait_s": [], "checkpoint_write_s": []}
    for line in (path.read_text(encoding="utf-8").splitlines() if path.exists() else []):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        for key, values in found.items():
            if key in record:
                values.append(record[key])
    stalls, waits, writes = found.values()
    return {"checkpoint_saves": len(stalls), "checkpoint_s_mean": _mean(stalls),
            "checkpoint_s_max": max(stalls) if stalls else None,
            "checkpoint_wait_s_total": sum(waits) if waits else None,
            "checkpoint_write_s_mean": _mean(writes), "checkpoint_write_s_max": max(writes) if writes else None}


def _mean(values):
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def summarize(metrics_path, *, status: str, steps: int | None = None, tokens: int | None = None,
              wall_time_s: float | None = None, checkpoint: str | None = None, export: str | None = None) -> dict:
    """The run's summary from its metrics file. Means are over the logged intervals, the first excluded when there
    are three or more (it holds start-up: data loading into caches, kernel compilation)."""
    train, evals = read_metrics(metrics_path)
    if steps is not None:
        train = [r for r in train if r["step"] <= steps]
        evals = [r for r in evals if r["step"] <= steps]
    steady = train[1:] if len(train) >= 3 else train
    last = train[-1] if train else {}
    peaks = [r["peak_mem_gib"] for r in train if "peak_mem_gib" in r]
    host = [r["host_peak_mem_gib"] for r in train if "host_peak_mem_gib" in r]
    return {
        "status": status,
        "steps": steps if steps is not None else last.get("step", 0),
        "tokens": tokens if tokens is not None else last.get("tokens_seen", 0),
        "wall_time_s": wall_time_s,
        "mean_tokens_per_s": _mean(r.get("tokens_per_s") for r in steady),
        "mean_tokens_per_s_per_device": _mean(r.get("tokens_per_s_per_device") for r in steady),
        "mean_tflops_per_device": _mean(r.get("tflops_per_device") for r in steady),
        "mean_mfu": _mean(r.get("mfu") for r in steady),
        "mean_step_time_s": _mean(r.get("step_time_s") for r in steady),
        "peak_mem_gib": max(peaks) if peaks else None,
        "host_peak_mem_gib": max(host) if host else None,
        "skipped_steps": last.get("skipped_steps"),
        **_save_stalls(metrics_path),
        "final_loss": last.get("loss"),
        "final_eval_loss": evals[-1]["eval_loss"] if evals else None,
        "final_eval_ppl": evals[-1].get("eval_ppl") if evals else None,  # none for preference pairs
        "final_eval_step": evals[-1]["step"] if evals else None,
        "final_pairs": _pair_metrics(last, evals[-1] if evals else {}),
        "checkpoint": checkpoint,
        "export": export,
        "metrics": str(Path(metrics_path)),
    }


def _pair_metrics(train: dict, evaluation: dict) -> dict | None:
    """Preference tuning's last logged rewards and log-probabilities, of training and of the held-out pairs."""
    found = {"train": {k: v for k, v in train.items() if k.startswith(PAIR_METRIC_KINDS)},
             "validation": {k[len("eval_"):]: v for k, v in evaluation.items()
                            if k.startswith(tuple(f"eval_{kind}" for kind in PAIR_METRIC_KINDS))}}
    return {tier: values for tier, values in found.items() if values} or None


def _hms(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def _saves(s: dict) -> str:
    """The checkpoint row's figures: how long training stood still per save (and waited for previous writes), and how
    long the background writes took."""
    if not s.get("checkpoint_saves"):
        return ""
    text = (f" ({s['checkpoint_saves']} saves, training stood still {s['checkpoint_s_mean']:.1f} s per save, "
            f"{s['checkpoint_s_max']:.1f} s at most")
    if (s.get("checkpoint_wait_s_total") or 0) >= 0.05:
        text += f", {s['checkpoint_wait_s_total']:.1f} s of it waiting for previous writes"
    if s.get("checkpoint_write_s_mean") is not None:
        text += (f"; background writes {s['checkpoint_write_s_mean']:.1f} s per save, "
                 f"{s['checkpoint_write_s_max']:.1f} s at most")
    return text + ")"


def format_summary(s: dict) -> list[str]:
    def num(v, fmt):
        return format(v, fmt) if v is not None else "n/a"

    rows = [
        ("status", s["status"]),
        ("steps", f"{s['steps']:,}"),
        ("tokens", f"{s['tokens']:,}"),
        ("wall time", f"{_hms(s['wall_time_s'])} ({s['wall_time_s']:.1f} s, this process)"
         if s.get("wall_time_s") is not None else "n/a"),
        ("mean tokens/s", f"{num(s['mean_tokens_per_s'], ',.0f')} ({num(s['mean_tokens_per_s_per_device'], ',.0f')} "
                          f"per device; step {num(s['mean_step_time_s'], '.3f')} s, slowest rank)"),
        ("mean MFU", f"{100 * s['mean_mfu']:.1f}% ({s['mean_tflops_per_device']:.1f} TFLOP/s per GPU)"
         if s.get("mean_mfu") is not None else
         f"n/a: no GPU peak known ({num(s['mean_tflops_per_device'], '.3f')} TFLOP/s per device)"),
        ("peak memory", "; ".join(x for x in [
            f"GPU {s['peak_mem_gib']:.2f} GiB" if s.get("peak_mem_gib") is not None else None,
            f"host {s['host_peak_mem_gib']:.2f} GiB (rank 0)" if s.get("host_peak_mem_gib") is not None else None]
            if x) or "n/a"),
        ("skipped updates", f"{s['skipped_steps']} (non-finite gradients: overflow)"
         if s.get("skipped_steps") is not None else "n/a"),
        ("final loss", f"train {num(s['final_loss'], '.4f')}, validation {num(s['final_eval_loss'], '.4f')} "
                       f"(perplexity {num(s['final_eval_ppl'], '.2f')})"),
        ("checkpoint", (s.get("checkpoint") or "none") + _saves(s)),
        ("export", s.get("export") or "none"),
    ]
    if s.get("preference"):  # the objective and its last rewards
        p, pairs = s["preference"], s.get("final_pairs") or {}
        rows.insert(-2, ("preference", f"{p['objective']}, beta {p['beta']:g}" + "".join(
            f"; {tier} rewards/accuracies {m['rewards/accuracies']:.3f}, rewards/margins {m['rewards/margins']:.4f}"
            for tier, m in pairs.items())))
    if s.get("incomplete_checkpoints_moved"):  # a save cut short before this start: kept, never resumed from
        moved = s["incomplete_checkpoints_moved"]
        rows.insert(-2, ("incomplete ckpts", f"{len(moved)} moved aside at the start: " + "; ".join(moved)))
    width = max(len(k) for k, _ in rows)
    return ["run summary " + "-" * 60] + [f"  {k.ljust(width)}  {v}" for k, v in rows]


def write_summary(run, status: str, export: str | None = None) -> dict | None:
    """Rank 0: print the summary table and write CHECKPOINT_DIR/summary.json; returns the summary (None elsewhere).
    `run`: train.run.Run."""
    log, run_dir = run.log, run.run_dir
    if log.sinks is not None:
        log.sinks.close()
    if not run.dist.is_main:
        return None
    name, _ = read_latest(run_dir.root)  # a `latest` that names no complete checkpoint was warned about at the start
    checkpoint = str(run_dir.root / name) if name else None
    summary = summarize(run_dir.metrics, status=status, steps=run.step, tokens=run.tokens_seen,
                        wall_time_s=time.time() - log.start_time, checkpoint=checkpoint, export=export)
    summary["incomplete_checkpoints_moved"] = list(run.incomplete_moved)
    summary["environment"] = environment(run.dist)
    summary["speed_levers"] = {"settings": run.cfg.speed.as_dict(), "in_force": run.speed_in_force}
    summary["preference"] = run.preference.as_manifest() if run.preference else None
    if log.sinks is not None and log.sinks.paths:
        summary["sinks"] = log.sinks.paths
    run_dir.root.mkdir(parents=True, exist_ok=True)
    tmp = run_dir.summary.with_name(SUMMARY + ".tmp")
    tmp.write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    tmp.replace(run_dir.summary)
    for line in format_summary(summary) + [f"  (also {run_dir.summary})"]:
        log.info(line)
    return summary



__all__ = ["Sinks", "environment", "format_summary", "header_lines", "prepare_ds_monitor", "read_metrics",
           "start_run_log", "summarize", "write_summary"]
