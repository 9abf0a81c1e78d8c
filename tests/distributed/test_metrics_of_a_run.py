"""Monitoring on a real run (2 CPU ranks): every metric key and its value, the LR schedule, TensorBoard events read
back, plots, the run summary, the log header, and a preempted run whose resume continues the events."""

from __future__ import annotations

import json
import math
import signal
import sys

import pytest
import torch
import preloaded
from conftest import FAST_ARGS, SRC, Trainer, assert_ok, run_trainer
from inputs import png_shape

MON_ARGS = [*FAST_ARGS, "--max_steps", "8", "--log_interval", "1", "--eval_interval", "4", "--warmup_steps", "3",
            "--no-export"]


TOKENS_PER_STEP = 2 * 2 * 64  # micro 2 x world 2 x seq 64 (FAST_ARGS)


TRAIN_KEYS = {"step", "loss", "lr", "grad_norm", "tokens_seen", "tokens_per_s", "tokens_per_s_per_device",
              "tflops_per_device", "step_time_s", "step_time_min_s", "host_mem_gib", "host_peak_mem_gib"}


def _read_tb(log_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


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


def test_metrics_have_every_key_and_sane_values(monitored):
    records = monitored.train_records()
    assert [r["step"] for r in records] == list(range(1, 9))
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


def test_learning_rate_follows_the_schedule(monitored):
    """The lr logged at step s is the one step s trained with: the schedule's iteration s - 1, so exactly one step
    (the first) at the warm-up floor and the last at the cosine's end."""
    from deepspeed.runtime.lr_schedules import WarmupCosineLR

    ds = _resolved_ds_config(monitored.output)
    assert ds["scheduler"]["type"] == "WarmupCosineLR" and ds["scheduler"]["params"]["warmup_num_steps"] == 3
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=ds["optimizer"]["params"]["lr"])
    sched = WarmupCosineLR(opt, **ds["scheduler"]["params"])
    expected = {}
    for step in range(1, 9):
        sched.step(step - 1)
        expected[step] = opt.param_groups[0]["lr"]
    got = {r["step"]: r["lr"] for r in monitored.train_records()}
    assert got == pytest.approx({s: expected[s] for s in got}, rel=1e-9)
    # The same by hand: linear warm-up over iterations 0-2 (steps 1-3), then cosine from the peak to 0.1 x peak over
    # the 5 remaining steps, the last step at its end.
    peak = ds["optimizer"]["params"]["lr"]
    assert [got[s] for s in (1, 2, 3)] == pytest.approx([0.0, peak / 3, peak * 2 / 3])
    for step in range(4, 9):
        assert got[step] == pytest.approx(peak * (0.1 + 0.9 * (1 + math.cos(math.pi * (step - 3) / 5)) / 2))
    assert got[8] == pytest.approx(peak * 0.1)


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


def test_plot_command_writes_pngs_of_the_expected_size(monitored, tmp_path):
    out = tmp_path / "plots"
    proc = preloaded.run([sys.executable, "-m", "model_utils.plot", str(monitored.checkpoint_dir), "--out", str(out)],
                         cwd=SRC, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    names = ["overview", "loss", "loss_tokens", "lr", "throughput", "mfu", "memory"]
    assert proc.stdout.split() == [str(out / f"{n}.png") for n in names]
    assert png_shape(out / "overview.png") == (900, 1600)
    for name in names[1:]:
        assert png_shape(out / f"{name}.png") == (500, 800), name


def test_summary_matches_the_metrics(monitored):
    summary = json.loads((monitored.checkpoint_dir / "summary.json").read_text())
    records = monitored.train_records()
    evals = [r for r in monitored.metrics() if "eval_loss" in r]
    assert summary["status"] == "completed"
    assert (summary["steps"], summary["tokens"]) == (8, 8 * TOKENS_PER_STEP)
    assert summary["mean_tokens_per_s"] == pytest.approx(sum(r["tokens_per_s"] for r in records[1:]) / 7)
    assert summary["mean_step_time_s"] == pytest.approx(sum(r["step_time_s"] for r in records[1:]) / 7)
    assert summary["host_peak_mem_gib"] == max(r["host_peak_mem_gib"] for r in records)
    assert summary["mean_mfu"] is None and summary["peak_mem_gib"] is None  # CPU
    assert (summary["final_loss"], summary["final_eval_loss"]) == (records[-1]["loss"], evals[-1]["eval_loss"])
    assert summary["checkpoint"] == str(monitored.checkpoint_dir / "step-00000008") and summary["export"] is None
    assert 0 < summary["wall_time_s"] < 600 and summary["environment"]["world_size"] == 2
    table = monitored.output[monitored.output.index("run summary"):]
    assert "completed" in table and f"train {records[-1]['loss']:.4f}" in table and "step-00000008" in table


def test_log_header_on_rank_0_only_and_no_duplicated_output(monitored):
    out0, out1 = monitored.outputs
    for text in ("run: no SLURM job", "world size 2 (gloo, cpu)", f"torch {torch.__version__}", "deepspeed 0.",
                 "config (effective flags): ", "config (DeepSpeed, resolved): ", "memory: ~", " GiB per GPU estimated",
                 "checkpoints: ~"):
        assert text in out0, text
    assert out0.index("versions:") < out0.index("data:")  # at the top
    for text in ("versions:", "config (", "run summary", "step 2 |", "eval step", "lr_schedules", "memory: ~"):
        assert text not in out1, text


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
