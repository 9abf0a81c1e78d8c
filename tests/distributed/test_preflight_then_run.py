"""The preflight and the run it plans: a clean configuration passes, then trains; what only the training hardware
can show (bf16 support) stops the run before the model is built."""

from __future__ import annotations

from conftest import FAST_ARGS, REPO, assert_ok, preflight_command, run_trainer
from inputs import ds_with, set_key


def test_clean_configuration_passes_preflight_then_trains(tmp_path, session_cache):
    args = [*FAST_ARGS, "--max_steps", "3", "--checkpoint_freq", "0", "--no-export"]
    proc, seconds = preflight_command([*args, "--checkpoint_dir", str(tmp_path / "ckpt")], {"WORLD_SIZE": "2"}, REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for words in ("effective DeepSpeed config", "batch: micro 2 x grad_acc 1 x world 2 = 4 blocks", "plan: 3 steps",
                  "model: tiny", "memory: ~", "preflight: OK"):
        assert words in proc.stdout
    assert_ok(run_trainer(tmp_path / "ckpt", args))


def test_bf16_on_hardware_without_it_stops_the_run_before_the_model_is_built(tmp_path, session_cache):
    """On a login node preflight cannot see the GPUs' bf16 support; the run's own start-up check does."""
    bad = ds_with(tmp_path, set_key(["bf16", "enabled"], True))
    run = run_trainer(tmp_path / "ckpt", [*FAST_ARGS, "--ds_config", bad], nproc=1)
    assert run.returncode == 2
    assert "bf16.enabled = True: this hardware has no bf16 support" in run.output and '"auto"' in run.output
    assert not (tmp_path / "ckpt" / "metrics.jsonl").exists()
