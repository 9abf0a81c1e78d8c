"""benchmarks/your_model_timing.py's two sides as the trainer plans them (in process, the preflight: no steps, the
figure itself is a GPU's): the preset with its speed options off on random blocks, and the preset's architecture
through the extension point on random blocks of your own, at the same batch."""

from __future__ import annotations

import argparse
import sys

from conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import your_model_timing  # noqa: E402

from model_utils.config.flags import parse_args  # noqa: E402
from model_utils.planning.preflight import run_preflight  # noqa: E402


def test_both_sides_plan_the_same_batch(tmp_path):
    a = argparse.Namespace(model="tiny", seq_len=32, micro_batch_size=2, steps=3, blocks=16, ds_config="ds_config.json")
    batches = []
    for side in ("preset", "yours"):
        cfg = parse_args(["--checkpoint_dir", str(tmp_path / side), *your_model_timing.side_argv(side, a)])
        report = run_preflight(cfg, world_size=1)
        assert not report.problems, report.problems
        batches.append(next(line for line in report.lines if line.startswith("batch:")))
    assert batches[0] == batches[1] == "batch: micro 2 x grad_acc 1 x world 1 = 2 blocks of 32 tokens = 64 tokens/step"
