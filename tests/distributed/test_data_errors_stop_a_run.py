"""A data error in a real run (2 CPU ranks) and in its preflight: the file and line named, exit 2 before any step,
no traceback."""

from __future__ import annotations

import os
import sys

import preloaded
from conftest import FAST_ARGS, REPO, TRAINER, run_trainer
from inputs import bad_jsonl_line


def test_a_real_run_and_its_preflight_stop_before_any_step_naming_the_line(session_cache, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    path, words = bad_jsonl_line(data)
    args = [*FAST_ARGS, "--dataset", str(data), "--data_cache_dir", str(tmp_path / "cache"), "--max_steps", "2"]
    run = run_trainer(tmp_path / "ckpt", args)
    assert run.returncode == 2, run.output
    assert f"--dataset = {path}: {words}" in run.output and "Traceback" not in run.output
    assert not (tmp_path / "ckpt" / "metrics.jsonl").exists() or "loss" not in (tmp_path / "ckpt" / "metrics.jsonl").read_text()
    proc = preloaded.run([sys.executable, str(TRAINER), "--preflight", *args, "--checkpoint_dir", str(tmp_path / "c")],
                         cwd=REPO, capture_output=True, text=True, timeout=300, env=dict(os.environ, WORLD_SIZE="1"))
    assert proc.returncode == 2 and f"--dataset = {path}: {words}" in proc.stdout, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
