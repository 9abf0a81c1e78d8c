"""DeepSpeed's own launcher convention, as DeepSpeedExamples and the seeds' ZeRO-3 guide use it: `deepspeed
train.py --deepspeed --deepspeed_config CONFIG`. The real launcher starts 2 CPU processes (gloo)."""

from __future__ import annotations

import os
import subprocess
import sys

from conftest import REPO, TRAINER


def test_deepspeed_launcher_with_deepspeed_config_trains_with_that_config(session_cache, tmp_path):
    ckpt = tmp_path / "ckpt"
    proc = subprocess.run(
        [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", "29731", str(TRAINER),
         "--deepspeed", "--deepspeed_config", "configs/zero1.json", "--max_steps", "3", "--seq_len", "64",
         "--micro_batch_size", "2", "--eval_iters", "1", "--log_interval", "1", "--checkpoint_dir", str(ckpt),
         "--no-export"],
        cwd=REPO, capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "--local_rank=0" in out  # the launcher's own argument reached the trainer, which accepted it
    assert "world size 2" in out and "ZeRO stage 1" in out  # --deepspeed_config is --ds_config
    assert (ckpt / "latest").read_text() == "step-00000003"
