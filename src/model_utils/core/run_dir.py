"""Every path under --checkpoint_dir, named in one place.

    CHECKPOINT_DIR/
      step-00000100/            a checkpoint (DeepSpeed's files, rng/, manifest.json written last)
      latest                    the name of the newest complete checkpoint
      incomplete/step-N[.k]     checkpoints a start found incomplete, moved aside
      run.lock                  the run that owns the directory (runtime/run_lock.py)
      config.yaml               the run's effective flags, as `--config` takes them (config/run_file.py)
      metrics.jsonl             one JSON record per log step, evaluation and save
      summary.json              how the run ended, written at its end
      tensorboard/              TensorBoard events (--tensorboard)
      wandb_run_id, wandb/      the W&B run a resumed run continues, and W&B's own files (--wandb)
      data_trace/rank-N.jsonl   the blocks each rank read (--trace_data)
      hf/                       the exported Hugging Face model (unless --export_dir names another place)
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

CHECKPOINT_NAME = re.compile(r"^step-(\d{8})$")
MANIFEST = "manifest.json"  # inside a checkpoint: written last, so its presence marks a complete one
LATEST = "latest"
INCOMPLETE = "incomplete"
LOCK = "run.lock"
RUN_CONFIG = "config.yaml"
METRICS = "metrics.jsonl"
SUMMARY = "summary.json"
TENSORBOARD = "tensorboard"
WANDB_RUN_ID = "wandb_run_id"
DATA_TRACE = "data_trace"
EXPORT = "hf"


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}"


@dataclass(frozen=True)
class RunDir:
    """The run directory (--checkpoint_dir) and the export directory (--export_dir, default inside it)."""

    root: Path
    export_override: Path | None = None

    @classmethod
    def of(cls, checkpoint_dir: str | Path, export_dir: str | Path | None = None) -> RunDir:
        return cls(Path(checkpoint_dir), Path(export_dir) if export_dir else None)

    def checkpoint(self, step: int) -> Path:
        return self.root / checkpoint_name(step)

    @property
    def latest(self) -> Path:
        return self.root / LATEST

    @property
    def incomplete(self) -> Path:
        return self.root / INCOMPLETE

    @property
    def lock(self) -> Path:
        return self.root / LOCK

    @property
    def config(self) -> Path:
        return self.root / RUN_CONFIG

    @property
    def metrics(self) -> Path:
        return self.root / METRICS

    @property
    def summary(self) -> Path:
        return self.root / SUMMARY

    @property
    def tensorboard(self) -> Path:
        return self.root / TENSORBOARD

    @property
    def wandb_run_id(self) -> Path:
        return self.root / WANDB_RUN_ID

    @property
    def data_trace(self) -> Path:
        return self.root / DATA_TRACE

    @property
    def export(self) -> Path:
        return self.export_override or self.root / EXPORT
