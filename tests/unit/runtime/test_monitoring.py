"""Monitoring: metrics of a real CPU run, TensorBoard events, plots, the run summary, the log header, W&B absence."""

from __future__ import annotations

import json
import math
import time
from types import SimpleNamespace

import pytest
import torch
from inputs import png_shape

from model_utils.config.checks import validate_args
from model_utils.config.flags import parse_args
from model_utils.core.run_dir import RunDir
from model_utils.runtime import monitor


def _fake_dist(rank=0, world=2):
    return SimpleNamespace(rank=rank, world_size=world, is_main=rank == 0, backend="gloo", device=torch.device("cpu"))


def _write_metrics(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


# ----------------------------------------------------------------------------------------------------------------------
# Without training
# ----------------------------------------------------------------------------------------------------------------------
def test_summary_takes_the_last_record_of_each_step_and_skips_the_start_up_interval(tmp_path):
    base = {"lr": 1e-4, "grad_norm": 1.0, "tflops_per_device": 100.0, "mfu": 0.1, "step_time_s": 0.5}
    records = [
        {**base, "step": 10, "loss": 5.0, "tokens_seen": 100, "tokens_per_s": 10.0, "peak_mem_gib": 3.0},
        {**base, "step": 20, "loss": 4.0, "tokens_seen": 200, "tokens_per_s": 99.0, "peak_mem_gib": 9.0},  # killed run
        {"step": 20, "eval_loss": 4.5, "eval_ppl": math.exp(4.5)},
        '{"step": 30, "loss": 3.',  # cut short by kill -9
        {**base, "step": 20, "loss": 4.1, "tokens_seen": 200, "tokens_per_s": 20.0, "peak_mem_gib": 4.0},  # resumed
        {**base, "step": 30, "loss": 3.0, "tokens_seen": 300, "tokens_per_s": 30.0, "mfu": 0.3, "peak_mem_gib": 5.0},
        {"step": 30, "eval_loss": 3.5, "eval_ppl": math.exp(3.5)},
    ]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    s = monitor.summarize(path, status="completed", wall_time_s=3725.0, checkpoint="ck/step-30", export="ck/hf")
    assert s["steps"] == 30 and s["tokens"] == 300
    assert s["mean_tokens_per_s"] == pytest.approx(25.0)  # steps 20 (resumed) and 30; step 10 is start-up
    assert s["mean_mfu"] == pytest.approx(0.2)
    assert s["peak_mem_gib"] == 5.0  # the killed run's 9.0 at step 20 was replaced
    assert (s["final_loss"], s["final_eval_loss"]) == (3.0, 3.5)
    table = "\n".join(monitor.format_summary(s))
    for text in ("completed", "1:02:05", "25 (", "20.0%", "GPU 5.00 GiB", "train 3.0000, validation 3.5000",
                 "ck/step-30", "ck/hf"):
        assert text in table, text
    # Up to a given step (a run stopped early): later records do not count.
    assert monitor.summarize(path, status="x", steps=20)["final_loss"] == 4.1


def test_plot_command_draws_gpu_metrics_from_several_runs(tmp_path):
    for name, speed in (("a", 1.0), ("b", 2.0)):
        (tmp_path / name).mkdir()
        _write_metrics(tmp_path / name / "metrics.jsonl", [
            {"step": s, "loss": 5 - s / 10, "lr": 1e-4, "tokens_seen": 1000 * s, "tokens_per_s": 1e4 * speed,
             "tflops_per_device": 300.0 * speed, "mfu": 0.3 * speed, "mem_gib": 10.0, "peak_mem_gib": 20.0}
            for s in (1, 2, 3)] + [{"step": 3, "eval_loss": 4.8, "eval_ppl": math.exp(4.8)}])
    from model_utils.plot import main

    assert main([str(tmp_path / "a"), str(tmp_path / "b" / "metrics.jsonl"), "--out", str(tmp_path / "out"),
                 "--dpi", "50"]) == 0
    assert png_shape(tmp_path / "out" / "overview.png") == (450, 800)
    assert png_shape(tmp_path / "out" / "memory.png") == (250, 400)


def test_plot_command_refuses_a_directory_without_metrics(tmp_path):
    from model_utils.plot import main

    with pytest.raises(SystemExit, match="no metrics.jsonl"):
        main([str(tmp_path), "--out", str(tmp_path / "out")])


def test_header_names_the_slurm_job_nodes_world_versions_and_flags(monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "gpu[01-04]")
    monkeypatch.setenv("SLURM_JOB_NUM_NODES", "4")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    text = "\n".join(monitor.header_lines(parse_args(["--max_steps", "7"]), _fake_dist(world=32)))
    for part in ("SLURM job 4242", "restart 2", "nodes gpu[01-04] (4)", "world size 32", f"torch {torch.__version__}",
                 "deepspeed 0.", "CUDA", "NCCL", '"max_steps": 7'):
        assert part in text, part


def test_wandb_flag_without_the_package_is_refused_with_the_fix(monkeypatch):
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real_find_spec(name, *a))
    problems = validate_args(parse_args(["--wandb"]))
    assert [p.setting for p in problems] == ["--wandb"]
    assert "pip install wandb" in str(problems[0]) and "WANDB_MODE=offline" in str(problems[0])


def test_sinks_fall_back_cleanly_without_tensorboard(tmp_path, monkeypatch):
    monkeypatch.setattr(monitor, "tensorboard_available", lambda: False)
    warnings = []
    log = SimpleNamespace(info=lambda m: None, warn=warnings.append)
    sinks = monitor.Sinks(parse_args(["--checkpoint_dir", str(tmp_path)]), RunDir(tmp_path), _fake_dist(), {}, log=log)
    sinks.write({"step": 1, "loss": 2.0})
    sinks.close()
    assert sinks.tb is None and "tensorboard is not installed" in warnings[0]
    assert not (tmp_path / "tensorboard").exists()


def test_deepspeed_monitor_gets_the_records_and_tensorboard_is_not_written_twice(tmp_path):
    events = []
    engine = SimpleNamespace(monitor=SimpleNamespace(enabled=True, write_events=events.extend))
    ds = {"tensorboard": {"enabled": True}}
    monitor.prepare_ds_monitor(ds, RunDir(tmp_path))
    assert ds["tensorboard"] == {"enabled": True, "output_path": str(tmp_path), "job_name": "tensorboard"}
    log = SimpleNamespace(info=lambda m: None, warn=lambda m: None)
    sinks = monitor.Sinks(parse_args(["--checkpoint_dir", str(tmp_path)]), RunDir(tmp_path), _fake_dist(), ds, engine, log=log)
    sinks.write({"step": 3, "loss": 2.5, "eval_loss": 2.0, "grad_norm": None})
    assert sinks.tb is None  # DeepSpeed's own TensorBoard writer has the events
    assert events == [("train/loss", 2.5, 3), ("eval/loss", 2.0, 3)]
    # Other ranks hold no sinks at all.
    assert monitor.Sinks(parse_args([]), RunDir(tmp_path), _fake_dist(rank=1), ds, engine).paths == {}


def test_wandb_offline_logs_without_network_and_a_resumed_run_keeps_its_id(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    log = SimpleNamespace(info=lambda m: None, warn=lambda m: pytest.fail(m))
    cfg = parse_args(["--checkpoint_dir", str(tmp_path), "--wandb", "--no-tensorboard", "--wandb_project", "t"])
    ids = []
    for steps in ((1, 2), (3,)):
        # W&B names an offline run's folder by the second it starts: a resume in the same second as the first run (only
        # possible in a test) would share its folder.
        time.sleep(1.01 - time.time() % 1)
        sinks = monitor.Sinks(cfg, cfg.checkpoint.run_dir, _fake_dist(), {"train_batch_size": 4}, log=log)
        for step in steps:
            sinks.write({"step": step, "loss": 5.0 - step, "eval_loss": None})
        ids.append(sinks.wandb.id)
        assert "offline" in sinks.paths["wandb"]
        if len(steps) > 1:  # W&B commits a step when the next one starts (or at finish)
            assert sinks.wandb.summary["train/loss"] == 4.0
        sinks.close()
    assert ids[0] == ids[1] == (tmp_path / "wandb_run_id").read_text()
    runs = list((tmp_path / "wandb").glob(f"offline-run-*-{ids[0]}/run-{ids[0]}.wandb"))
    assert len(runs) == 2 and all(r.stat().st_size > 0 for r in runs)  # `wandb sync` uploads these


@pytest.fixture
def full_disk(tmp_path):
    from inputs import mounted_tmpfs

    yield from mounted_tmpfs(tmp_path / "small", "64k")


def test_a_full_disk_under_metrics_jsonl_warns_once_and_training_goes_on(full_disk, capsys):
    """Appending a record to metrics.jsonl on a full filesystem (a real 64 KiB tmpfs) is no traceback: one warning
    naming the file and the cause, then the records that fit again are appended."""
    from model_utils.runtime.distributed import Dist
    from model_utils.runtime.run_log import Logger

    filler = full_disk / "filler"
    with open(filler, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"x" * 4096)
        except OSError:
            pass
    log = Logger(Dist(0, 0, 1, torch.device("cpu"), "gloo"), full_disk / "metrics.jsonl")
    for step in (1, 2):
        log.metrics({"step": step, "loss": 1.0})
    err = capsys.readouterr().err
    assert err.count("could not be appended") == 1
    assert f"{full_disk / 'metrics.jsonl'} could not be appended (No space left on device)" in err and "from step 1" in err
    filler.unlink()
    log.metrics({"step": 3, "loss": 1.0})
    assert [json.loads(line)["step"] for line in (full_disk / "metrics.jsonl").read_text().splitlines()] == [3]
