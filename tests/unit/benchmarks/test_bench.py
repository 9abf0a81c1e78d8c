"""The benchmark's own logic on CPU, module by module (benchmarks/): throughput and FLOPs arithmetic, the tables and
ratios (report), rounds and the out-of-memory sweep (bench), GPU telemetry with a stand-in nvidia-smi (telemetry), the
HF peer's DeepSpeed config (hf_peer), the idle-gap report (profiling), and the variants' trainer flags (bench)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))


def test_variants_set_every_lever_by_flag():
    """A variant names its levers and turns every other one off, as trainer flags the trainer's parser accepts."""
    import bench

    from model_utils.config.flags import parse_args
    from model_utils.config.settings import SpeedConfig

    cfg = parse_args(bench.VARIANTS["compile"]["args"])
    assert cfg.speed == SpeedConfig(liger_kernels="flce", flce_chunk_budget=1, compile="layers", activation_budget=1.0,
                                  attention_kernel="sdpa", overflow_check="scan", delayed_update_prefetch="off")
    assert parse_args(bench.VARIANTS["nofused"]["args"]).speed.fused_kernels == "off"
    assert parse_args(bench.VARIANTS["default"].get("args", [])).speed == SpeedConfig()
    for name, spec in bench.VARIANTS.items():
        parse_args(spec.get("args", []))  # every variant's flags parse


def test_throughput_arithmetic():
    import report

    r = report.throughput(8 * 4096, [0.5, 0.5, 0.5, 0.5], 6.0e9, 4.0e9, 989.0)
    assert r["tokens_per_s_per_gpu"] == pytest.approx(65536.0)
    assert r["tflops_per_gpu"] == pytest.approx(65536.0 * 6.0e9 / 1e12)
    assert r["mfu"] == pytest.approx(65536.0 * 6.0e9 / 1e12 / 989.0)
    assert r["mfu_6"] == pytest.approx(65536.0 * 4.0e9 / 1e12 / 989.0)
    assert "mfu" not in report.throughput(1, [1.0], 1.0, 1.0, None)
    # a stall: the mean moves, the median does not, and the record names the step
    stalled = report.throughput(8 * 4096, [0.5, 0.5, 2.0, 0.5], 6.0e9, 4.0e9, 989.0)
    assert (stalled["step_s_mean"], stalled["step_s_median"], stalled["step_s"]) == (0.875, 0.5, [0.5, 0.5, 2.0, 0.5])


def test_flops_per_token_conventions_for_qwen3_0_6b():
    import report

    from model_utils.models.build import model_config

    config = model_config("qwen3-0.6b")
    params = 596_049_920  # Qwen3-0.6B with tied embeddings, as counted on the GPU run
    f12, f6 = report.flops_per_token(config, params, 4096)
    attn = 28 * 16 * 128 * 4096
    assert f12 == 6 * params + 12 * attn  # tied: the LM head counts once, the embedding lookup not at all
    assert f6 == 6 * params + 6 * attn


def test_loss_check_and_table():
    import report

    lc = report.loss_check({"losses": [10.0, 9.0, 8.0]}, {"losses": [10.0, 9.01, 7.98]}, 50)
    assert lc["steps"] == 3 and lc["max_abs_diff"] == pytest.approx(0.02)
    jobs = [{"name": "a", "micro_batch_size": 8}, {"name": "ref", "micro_batch_size": 8}, {"name": "x", "micro_batch_size": 8}]
    res = [{"micro_batch_size": 8, "tokens_per_s_per_gpu": 120.0, "tflops_per_gpu": 1.0, "step_s_median": 0.1},
           {"micro_batch_size": 8, "tokens_per_s_per_gpu": 100.0, "tflops_per_gpu": 1.0, "step_s_median": 0.1},
           {"error": "out of memory"}]
    text = report.table(jobs, res, "ref")
    assert "1.20x" in text and "out of memory" in text


def test_ratios_per_micro_batch_and_best_micro_batch_each():
    import report

    def run(mb, tps):
        return {"micro_batch_size": mb, "tokens_per_s_per_gpu": tps, "tflops_per_gpu": 1.0, "step_s_median": 0.1}

    jobs = [{"name": "e8", "kind": "engine", "variant": "default", "micro_batch_size": 8},
            {"name": "h8", "kind": "hf", "liger": True, "attn": "sdpa", "micro_batch_size": 8},
            {"name": "e16", "kind": "engine", "variant": "default", "micro_batch_size": 16},
            {"name": "h16", "kind": "hf", "liger": True, "attn": "sdpa", "micro_batch_size": 16}]
    results = [run(8, 120.0), run(8, 100.0), run(16, 150.0), {"error": "out of memory"}]
    rows = report.table(jobs, results, "h8").splitlines()
    assert rows[2].endswith("| 1.20x |") and rows[4].endswith("| - |")  # h16 did not run: no ratio for e16
    best = report.best_per_side(jobs, results)
    assert "150 tokens/s at 16" in best and "100 at 8" in best and "failed at [16]" in best and best.endswith("1.50x")
    assert report.best_per_side(jobs[:2], results[:2]) == ""  # one micro-batch: nothing to choose
    no_liger = {"name": "n16", "kind": "hf", "liger": False, "attn": "sdpa", "micro_batch_size": 16}
    assert "failed at [16]" in report.best_per_side(jobs + [no_liger], results + [{"error": "out of memory"}])


def test_rounds_interleave_both_sides_and_pool_their_best_micro_batches():
    """--rounds N runs the invocation's measurements N times in turn (each side at its own micro-batches with
    --hf-micro-batch-size); each round's ratio is to that round's peer, and the pooled line takes each side's mean
    tokens/s at the micro-batch that is best on average."""
    import argparse

    import bench
    import report

    a = argparse.Namespace(model="tiny", seq_len=32, steps=2, warmup=1, seed=1, ds_config="ds_config.json",
                           zero_stage=None, gradient_checkpointing=False, profile=False, ds_set=[], document_length=0,
                           trace=None, nproc=1, micro_batch_size=[16], hf_micro_batch_size=[12, 16], rounds=3,
                           variants=["default"], compare_hf=True, hf_skip=["noliger"], hf_fa4=False, loss_check=5,
                           loss_check_reference="nofused", loss_check_variants=["default"], loss_check_mb=2,
                           global_batch_tokens=None, hf_gradient_checkpointing=None)
    names = [j["name"] for j in bench.make_jobs(a)]
    assert names == [f"{n}-r{k}" for k in (1, 2, 3) for n in ("engine-default-mb16", "hf-liger-mb16", "hf-liger-mb12")] \
        + ["losscheck-nofused-mb2", "losscheck-default-mb2"]  # interleaved rounds; the loss check once
    traced = bench.make_jobs(argparse.Namespace(**dict(vars(a), profile=True, trace="/tmp/traces", loss_check=0)))
    assert [j["trace"] for j in traced if j["kind"] == "engine"] == [
        f"/tmp/traces/engine-default-mb16-r{k}.json.gz" for k in (1, 2, 3)]  # a trace per round, none overwritten
    assert [j["name"] for j in bench.make_jobs(argparse.Namespace(**dict(vars(a), rounds=1, loss_check=0)))] == \
        ["engine-default-mb16", "hf-liger-mb16", "hf-liger-mb12"]  # one round: the names of old

    def run(mb, tps):
        return {"micro_batch_size": mb, "tokens_per_s_per_gpu": tps, "tflops_per_gpu": 1.0, "step_s_median": 0.1}

    jobs, results = [], []
    for k, (ours16, ours12, peer12) in enumerate([(120.0, 118.0, 100.0), (126.0, 125.0, 100.0), (120.0, 130.0, 110.0)], 1):
        jobs += [{"name": f"e16-r{k}", "kind": "engine", "variant": "default", "micro_batch_size": 16, "round": k},
                 {"name": f"e12-r{k}", "kind": "engine", "variant": "default", "micro_batch_size": 12, "round": k},
                 {"name": f"h12-r{k}", "kind": "hf", "liger": True, "attn": "sdpa", "micro_batch_size": 12, "round": k},
                 {"name": f"h16-r{k}", "kind": "hf", "liger": True, "attn": "sdpa", "micro_batch_size": 16, "round": k}]
        results += [run(16, ours16), run(12, ours12), run(12, peer12), {"error": "out of memory"}]
    rows = report.table(jobs, results, None).splitlines()
    assert rows[3].endswith("| 1.18x |") and rows[11].endswith("| 1.18x |")  # each round's own peer (130/110)
    lines = report.best_per_side(jobs, results).splitlines()
    assert lines[0] == ("Round 1, best micro-batch each: default path 120 tokens/s at 16, HF + Liger 100 at 12 "
                        "(failed at [16]): 1.200x")
    assert lines[2].endswith("default path 130 tokens/s at 12, HF + Liger 110 at 12 (failed at [16]): 1.182x")
    # pooled: ours 124.3 at 12 (16 averages 122), the peer 103.3 at 12; rounds 1.200x, 1.260x, 1.182x
    assert lines[3] == ("Over 3 rounds, each side's mean at its best micro-batch: default path 124 tokens/s at 12, "
                        "HF + Liger 103 at 12 (failed at [16]): 1.203x (rounds 1.182x-1.260x, median 1.200x)")


def test_global_batch_and_the_peers_checkpointing_settings():
    """--global_batch_tokens gives both sides the same tokens per optimizer step (accumulation = tokens / (micro-batch
    x GPUs x seq_len)); --hf-gradient-checkpointing measures the peer with each setting; a global batch some measured
    micro-batch cannot divide stops bench.py before any run."""
    import argparse

    import bench

    a = argparse.Namespace(model="tiny", seq_len=32, steps=2, warmup=1, seed=1, ds_config="ds_config.json",
                           zero_stage=None, gradient_checkpointing=False, profile=False, ds_set=[], document_length=0,
                           trace=None, nproc=2, micro_batch_size=[2], hf_micro_batch_size=[1, 4], rounds=1,
                           variants=["default"], compare_hf=True, hf_skip=["noliger"], hf_fa4=False, loss_check=0,
                           global_batch_tokens=512, hf_gradient_checkpointing=["off", "on"])
    jobs = bench.make_jobs(a)
    assert [j["name"] for j in jobs] == ["engine-default-mb2-ga4", "hf-liger-mb1-ga8", "hf-liger-mb1-ga8-gc",
                                         "hf-liger-mb4-ga2", "hf-liger-mb4-ga2-gc"]
    assert jobs[0]["global_batch_tokens"] == 512  # the trainer derives its own accumulation from it
    assert [(j["gradient_accumulation_steps"], j["gradient_checkpointing"]) for j in jobs[1:]] == [
        (8, False), (8, True), (2, False), (2, True)]
    assert all(j["dummy_blocks"] >= (2 + 1) * 512 // 32 for j in jobs)  # every timed and warm-up step, whole
    assert bench.global_batch_problem(a) is None
    odd = argparse.Namespace(**dict(vars(a), hf_micro_batch_size=[3]))
    assert "not a multiple of micro-batch 3 x 2 GPU(s) x seq_len 32 = 192 tokens" in bench.global_batch_problem(odd)


def test_several_processes_share_the_hosts_cores_on_both_sides():
    """torchrun sets OMP_NUM_THREADS=1 for several processes, which would leave each rank's CPU Adam one core on both
    sides: the measurement's processes get the cores divided among them, unless the caller chose a count; one process
    keeps torch's own count; an enclosing launcher's rank variables do not leak in."""
    import bench

    outer = {"RANK": "3", "LOCAL_WORLD_SIZE": "8", "PATH": "/bin"}
    assert bench.worker_env(outer, 2, 16)["OMP_NUM_THREADS"] == "8"
    assert bench.worker_env(outer, 4, 2)["OMP_NUM_THREADS"] == "1"
    assert "OMP_NUM_THREADS" not in bench.worker_env(outer, 1, 16)
    assert bench.worker_env({**outer, "OMP_NUM_THREADS": "3"}, 2, 16)["OMP_NUM_THREADS"] == "3"
    env = bench.worker_env(outer, 2, 16)
    assert "RANK" not in env and "LOCAL_WORLD_SIZE" not in env and env["PATH"] == "/bin"


def test_sweep_skips_larger_micro_batches_after_out_of_memory():
    import bench

    jobs = [{"name": f"{v}-{mb}", "variant": v, "micro_batch_size": mb} for mb in (4, 8, 12, 16) for v in ("a", "b")]
    ran = []

    def run(job):
        ran.append(job["name"])
        fits = job["micro_batch_size"] <= (12 if job["variant"] == "a" else 4)
        return {"tokens_per_s_per_gpu": 1.0} if fits else {"error": "out of memory"}

    results = bench.run_jobs(jobs, run, lambda job, r: None)
    assert ran == ["a-4", "b-4", "a-8", "b-8", "a-12", "a-16"]
    assert [r.get("error") for r in results] == [None, None, None, "out of memory", None,
                                                 "skipped (out of memory at 8)", "out of memory",
                                                 "skipped (out of memory at 8)"]


def test_gpu_samples_summary():
    """Rows as nvidia-smi printed them on the H100 (clock MHz, power W, clock event reasons), one it cannot fill."""
    import telemetry

    rows = ["1695, 693.50, 0x0000000000000004", "1980, 121.39, 0x0000000000000000",
            "1455, 696.23, 0x0000000000000084", "[N/A], [N/A], [N/A]", "1710"]
    summary = telemetry.summarize_gpu_samples(rows)
    assert summary["gpu_samples"] == 3
    assert summary["sm_clock_mhz"] == pytest.approx((1695 + 1980 + 1455) / 3)
    assert summary["power_w"] == pytest.approx((693.50 + 121.39 + 696.23) / 3)
    assert summary["power_limited_share"] == pytest.approx(2 / 3)  # SW power cap, and HW power brake with it
    assert telemetry.summarize_gpu_samples(["1980, 70.0, 0x0000000000000001"])["power_limited_share"] == 0  # idle
    assert telemetry.summarize_gpu_samples([]) == {}


def test_gpu_telemetry_samples_the_run_gpus(tmp_path, monkeypatch):
    """No GPU here: a stand-in nvidia-smi on PATH records its arguments and prints rows as `-lms` does."""
    import report
    import telemetry

    fake = tmp_path / "nvidia-smi"
    fake.write_text(f"#!/bin/sh\necho \"$@\" > {tmp_path}/args\n"
                    "echo '1700, 690.0, 0x0000000000000004'\necho '1800, 600.0, 0x0000000000000000'\nexec sleep 60\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5,6")
    sampler = telemetry.GpuTelemetry(2, interval_ms=50).start()
    for _ in range(100):  # until the stand-in has printed its rows
        if (tmp_path / "args").exists() and os.fstat(sampler.samples.fileno()).st_size >= 62:  # both rows
            break
        time.sleep(0.05)
    summary = sampler.stop()
    assert summary == {"sm_clock_mhz": 1750.0, "power_w": 645.0, "power_limited_share": 0.5, "gpu_samples": 2}
    args = (tmp_path / "args").read_text().split()
    assert args[args.index("-i") + 1] == "3,5" and args[args.index("-lms") + 1] == "50"
    assert sampler.stop() == {}  # stopped once; a second stop has nothing to add
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert telemetry.GpuTelemetry(1).start().stop() == {}  # no nvidia-smi (CPU machine): no figures, no error
    rows = report.table([{"name": "e", "micro_batch_size": 8}],
                        [{"micro_batch_size": 8, "tokens_per_s_per_gpu": 1.0, "tflops_per_gpu": 1.0,
                          "step_s_median": 0.1, **summary}], None).splitlines()
    assert "| 1,750 / 645 / 50% |" in rows[2]


def test_hf_config_has_autos_for_trainer_owned_values(tmp_path):
    import hf_peer

    ds = hf_peer.hf_ds_config({"ds_config": "ds_config.json", "zero_stage": None}, tmp_path)
    assert ds["train_micro_batch_size_per_gpu"] == "auto" and ds["optimizer"]["params"]["lr"] == "auto"
    assert ds["zero_optimization"]["stage"] in (1, 2)
    ds0 = hf_peer.hf_ds_config({"ds_config": "ds_config.json", "zero_stage": 0}, tmp_path)
    assert ds0["zero_optimization"] == {"stage": 0}


def test_gpu_idle_report_attributes_gaps_to_the_host():
    """A synthetic Kineto trace: two kernels 1 ms apart while the host is in the step phase's `norm` operator."""
    import profiling

    events = [
        {"ph": "X", "cat": "user_annotation", "name": "phase:backward", "ts": 0, "dur": 1000},
        {"ph": "X", "cat": "user_annotation", "name": "phase:step", "ts": 1000, "dur": 3000},
        {"ph": "X", "cat": "cpu_op", "name": "step", "ts": 1000, "dur": 3000},
        {"ph": "X", "cat": "cpu_op", "name": "norm", "ts": 1100, "dur": 1000},
        {"ph": "X", "cat": "cpu_op", "name": "adam", "ts": 2100, "dur": 200},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 2150, "dur": 10, "args": {"correlation": 7}},
        {"ph": "X", "cat": "kernel", "name": "backward_kernel", "ts": 100, "dur": 1100},
        {"ph": "X", "cat": "kernel", "name": "small", "ts": 1205, "dur": 5},  # a 5 us gap: below the threshold
        {"ph": "X", "cat": "kernel", "name": "adam_kernel", "ts": 2210, "dur": 800, "args": {"correlation": 7}},
    ]
    report = profiling.gpu_idle_report(events, min_gap_us=20).splitlines()
    assert report[0].startswith("gpu idle: 1.0 ms of 2.9 ms") and "in 1 gaps" in report[0]
    assert "step 1.0 ms" in report[0]
    assert "host in norm" in report[1] and "ended by adam_kernel launched from adam" in report[1]
    assert profiling.gpu_idle_report([]) == "gpu idle: no GPU events in the trace"


def test_layer_activations_takes_one_layers_bytes_per_token_from_the_layer_difference():
    """benchmarks/layer_activations.py: (kept with 3 layers - kept with 1) / 2 layers / the batch's tokens, per
    micro-batch; the embedding, the loss and the logits, the same in both models, cancel."""
    import layer_activations

    def row(layers, micro):  # 1,000 bytes of loss state, 100 per token of the embedding, 40 per token and layer
        tokens = micro * 8
        return {"model": "m", "layers": layers, "micro_batch_size": micro, "seq_len": 8, "hidden_size": 4,
                "kept_bytes": 1000 + 100 * tokens + 40 * layers * tokens, "levers": {}, "lora_rank": 0,
                "lora_dropout": None, "estimate_compiled_bytes_per_token": 38, "estimate_eager_bytes_per_token": 50}

    lines = layer_activations.per_layer([row(layers, micro) for layers in (1, 3) for micro in (1, 2)])
    assert [(line["micro_batch_size"], line["bytes_per_token"], line["per_hidden"]) for line in lines] == [
        (1, 40.0, 10.0), (2, 40.0, 10.0)]
