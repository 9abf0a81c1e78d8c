"""Monitoring: metrics of a real CPU run, TensorBoard events, plots, the run summary, the log header, W&B absence."""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from conftest import FAST_ARGS, SRC, Trainer, assert_ok, run_trainer
from model_utils import monitor
from model_utils.arguments import parse_args, validate_args

MON_ARGS = [*FAST_ARGS, "--max_steps", "8", "--log_interval", "2", "--eval_interval", "4", "--warmup_steps", "3",
            "--no-export"]
TOKENS_PER_STEP = 2 * 2 * 64  # micro 2 x world 2 x seq 64 (FAST_ARGS)
TRAIN_KEYS = {"step", "loss", "lr", "grad_norm", "tokens_seen", "tokens_per_s", "tokens_per_s_per_device",
              "tflops_per_device", "step_time_s", "step_time_min_s", "host_mem_gib", "host_peak_mem_gib"}


def _fake_dist(rank=0, world=2):
    return SimpleNamespace(rank=rank, world_size=world, is_main=rank == 0, backend="gloo", device=torch.device("cpu"))


def _write_metrics(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def _read_tb(log_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _png_shape(path):
    import matplotlib.image

    return matplotlib.image.imread(path).shape[:2]


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
    assert _png_shape(tmp_path / "out" / "overview.png") == (450, 800)
    assert _png_shape(tmp_path / "out" / "memory.png") == (250, 400)


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
    sinks = monitor.Sinks(parse_args(["--checkpoint_dir", str(tmp_path)]), _fake_dist(), {}, log=log)
    sinks.write({"step": 1, "loss": 2.0})
    sinks.close()
    assert sinks.tb is None and "tensorboard is not installed" in warnings[0]
    assert not (tmp_path / "tensorboard").exists()


def test_deepspeed_monitor_gets_the_records_and_tensorboard_is_not_written_twice(tmp_path):
    events = []
    engine = SimpleNamespace(monitor=SimpleNamespace(enabled=True, write_events=events.extend))
    ds = {"tensorboard": {"enabled": True}}
    monitor.prepare_ds_monitor(ds, tmp_path)
    assert ds["tensorboard"] == {"enabled": True, "output_path": str(tmp_path), "job_name": "tensorboard"}
    log = SimpleNamespace(info=lambda m: None, warn=lambda m: None)
    sinks = monitor.Sinks(parse_args(["--checkpoint_dir", str(tmp_path)]), _fake_dist(), ds, engine, log=log)
    sinks.write({"step": 3, "loss": 2.5, "eval_loss": 2.0, "grad_norm": None})
    assert sinks.tb is None  # DeepSpeed's own TensorBoard writer has the events
    assert events == [("train/loss", 2.5, 3), ("eval/loss", 2.0, 3)]
    # Other ranks hold no sinks at all.
    assert monitor.Sinks(parse_args([]), _fake_dist(rank=1), ds, engine).paths == {}


# ----------------------------------------------------------------------------------------------------------------------
# A real CPU run: 2 gloo ranks, 8 steps
# ----------------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def monitored(session_cache, tmp_path_factory):
    run = run_trainer(tmp_path_factory.mktemp("monitored") / "ckpt", MON_ARGS)
    assert_ok(run)
    return run


def _resolved_ds_config(output: str) -> dict:
    line = next(ln for ln in output.splitlines() if ln.startswith("config (DeepSpeed, resolved): "))
    return json.loads(line.split(": ", 1)[1])


@pytest.mark.slow
def test_metrics_have_every_key_and_sane_values(monitored):
    records = monitored.train_records()
    assert [r["step"] for r in records] == [2, 4, 6, 8]
    for r in records:
        assert TRAIN_KEYS <= r.keys(), TRAIN_KEYS - r.keys()
        assert r["tokens_seen"] == r["step"] * TOKENS_PER_STEP  # packed blocks: every token is a real target
        assert r["tokens_per_s"] > 0 and r["tokens_per_s_per_device"] == pytest.approx(r["tokens_per_s"] / 2)
        assert r["step_time_s"] >= r["step_time_min_s"] > 0
        assert r["tflops_per_device"] > 0 and "mfu" not in r  # CPU: no peak to divide by
        assert math.isfinite(r["loss"]) and 0 < r["loss"] < 12 and r["grad_norm"] > 0
        assert 0 < r["host_mem_gib"] <= r["host_peak_mem_gib"]
    evals = [r for r in monitored.metrics() if "eval_loss" in r]
    assert [r["step"] for r in evals] == [4, 8]
    assert all(r["eval_ppl"] == pytest.approx(math.exp(r["eval_loss"])) for r in evals)


@pytest.mark.slow
def test_learning_rate_follows_the_schedule(monitored):
    """The lr logged at step s is the one step s used: the scheduler's value after s-1 updates."""
    from deepspeed.runtime.lr_schedules import WarmupCosineLR

    ds = _resolved_ds_config(monitored.output)
    assert ds["scheduler"]["type"] == "WarmupCosineLR" and ds["scheduler"]["params"]["warmup_num_steps"] == 3
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=ds["optimizer"]["params"]["lr"])
    sched = WarmupCosineLR(opt, **ds["scheduler"]["params"])
    expected = {}
    for step in range(1, 9):
        expected[step] = opt.param_groups[0]["lr"]
        sched.step()
    got = {r["step"]: r["lr"] for r in monitored.train_records()}
    assert got == pytest.approx({s: expected[s] for s in got}, rel=1e-9)
    # The same by hand: step s uses scheduler iteration s - 2 (DeepSpeed's scheduler starts at -1, at lr 0);
    # linear warmup over 3 iterations, then cosine from the peak to 0.1 x peak over the 5 remaining steps.
    peak = ds["optimizer"]["params"]["lr"]
    assert got[2] == 0.0 and got[4] == pytest.approx(peak * 2 / 3)
    for step in (6, 8):
        assert got[step] == pytest.approx(peak * (0.1 + 0.9 * (1 + math.cos(math.pi * (step - 4) / 5)) / 2))


@pytest.mark.slow
def test_tensorboard_events_read_back_equal_the_metrics(monitored):
    scalars = _read_tb(monitored.checkpoint_dir / "tensorboard")
    records = monitored.train_records()
    for key, tag in (("loss", "train/loss"), ("lr", "train/lr"), ("tokens_per_s", "perf/tokens_per_s"),
                     ("step_time_s", "perf/step_time_s"), ("host_peak_mem_gib", "memory/host_peak_mem_gib")):
        assert [s for s, _ in scalars[tag]] == [r["step"] for r in records], tag
        assert [v for _, v in scalars[tag]] == pytest.approx([r[key] for r in records], rel=1e-6), tag
    evals = [r for r in monitored.metrics() if "eval_loss" in r]
    assert [s for s, _ in scalars["eval/loss"]] == [r["step"] for r in evals] == [4, 8]
    assert [v for _, v in scalars["eval/loss"]] == pytest.approx([r["eval_loss"] for r in evals], rel=1e-6)


@pytest.mark.slow
def test_plot_command_writes_pngs_of_the_expected_size(monitored, tmp_path):
    out = tmp_path / "plots"
    proc = subprocess.run([sys.executable, "-m", "model_utils.plot", str(monitored.checkpoint_dir), "--out", str(out)],
                          cwd=SRC, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    names = ["overview", "loss", "loss_tokens", "lr", "throughput", "mfu", "memory"]
    assert proc.stdout.split() == [str(out / f"{n}.png") for n in names]
    assert _png_shape(out / "overview.png") == (900, 1600)
    for name in names[1:]:
        assert _png_shape(out / f"{name}.png") == (500, 800), name


@pytest.mark.slow
def test_summary_matches_the_metrics(monitored):
    summary = json.loads((monitored.checkpoint_dir / "summary.json").read_text())
    records = monitored.train_records()
    evals = [r for r in monitored.metrics() if "eval_loss" in r]
    assert summary["status"] == "completed"
    assert (summary["steps"], summary["tokens"]) == (8, 8 * TOKENS_PER_STEP)
    assert summary["mean_tokens_per_s"] == pytest.approx(sum(r["tokens_per_s"] for r in records[1:]) / 3)
    assert summary["mean_step_time_s"] == pytest.approx(sum(r["step_time_s"] for r in records[1:]) / 3)
    assert summary["host_peak_mem_gib"] == max(r["host_peak_mem_gib"] for r in records)
    assert summary["mean_mfu"] is None and summary["peak_mem_gib"] is None  # CPU
    assert (summary["final_loss"], summary["final_eval_loss"]) == (records[-1]["loss"], evals[-1]["eval_loss"])
    assert summary["checkpoint"] == str(monitored.checkpoint_dir / "step-00000008") and summary["export"] is None
    assert 0 < summary["wall_time_s"] < 600 and summary["environment"]["world_size"] == 2
    table = monitored.output[monitored.output.index("run summary"):]
    assert "completed" in table and f"train {records[-1]['loss']:.4f}" in table and "step-00000008" in table


@pytest.mark.slow
def test_log_header_on_rank_0_only_and_no_duplicated_output(monitored):
    out0, out1 = monitored.outputs
    for text in ("run: no SLURM job", "world size 2 (gloo, cpu)", f"torch {torch.__version__}", "deepspeed 0.",
                 "config (effective flags): ", "config (DeepSpeed, resolved): ", "memory: ~", " GiB per GPU estimated",
                 "checkpoints: ~"):
        assert text in out0, text
    assert out0.index("versions:") < out0.index("data:")  # at the top
    for text in ("versions:", "config (", "run summary", "step 2 |", "eval step", "lr_schedules", "memory: ~"):
        assert text not in out1, text


@pytest.mark.slow
def test_preemption_writes_the_summary_and_resume_continues_the_events(session_cache, tmp_path):
    ckpt = tmp_path / "ckpt"
    args = [*FAST_ARGS, "--max_steps", "40", "--log_interval", "2", "--no-export"]
    first = Trainer(ckpt, args)
    metrics = ckpt / "metrics.jsonl"
    assert first.wait_for(lambda: metrics.exists() and '"step": 4' in metrics.read_text())
    first.procs[0].send_signal(signal.SIGUSR1)
    stopped = first.wait()
    assert stopped.returncodes == [75, 75], stopped.outputs
    summary = json.loads((ckpt / "summary.json").read_text())
    assert summary["status"].startswith("preempted: SIGUSR1") and 4 <= summary["steps"] < 40
    assert summary["checkpoint"] == str(ckpt / f"step-{summary['steps']:08d}")
    assert "run summary" in stopped.output and "preempted" in stopped.output

    resumed = run_trainer(ckpt, args)
    assert_ok(resumed)
    final = json.loads((ckpt / "summary.json").read_text())
    assert final["status"] == "completed" and final["steps"] == 40 and final["tokens"] == 40 * TOKENS_PER_STEP
    steps = [s for s, _ in _read_tb(ckpt / "tensorboard")["train/loss"]]
    assert steps == sorted(set(steps)) and steps[-1] == final["steps"]  # one value per step across the two runs


def test_wandb_offline_logs_without_network_and_a_resumed_run_keeps_its_id(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    log = SimpleNamespace(info=lambda m: None, warn=lambda m: pytest.fail(m))
    cfg = parse_args(["--checkpoint_dir", str(tmp_path), "--wandb", "--no-tensorboard", "--wandb_project", "t"])
    ids = []
    for steps in ((1, 2), (3,)):
        sinks = monitor.Sinks(cfg, _fake_dist(), {"train_batch_size": 4}, log=log)
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
