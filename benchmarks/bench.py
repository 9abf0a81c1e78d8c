#!/usr/bin/env python3
"""Training throughput benchmark on the project's real path, optionally against HF Trainer + DeepSpeed (+ Liger).

    python benchmarks/bench.py --model qwen3-0.6b --seq_len 4096 --micro_batch_size 8 --steps 10 --compare-hf
    python benchmarks/bench.py --model tiny --steps 2 --warmup 1            # CPU smoke run

Every measurement runs in its own process (fresh CUDA memory statistics, no monkey-patch leaking between variants),
on all GPUs present (torchrun --standalone) unless --nproc says otherwise. The engine path is the trainer's own:
`parse_args` -> `setup` (model, speed levers, DeepSpeed engine from ds_config.json) -> `train_step` and the loop's
per-step collective (`agree_after_step`), on `--dummy_data` random token blocks. After `--warmup` steps, `--steps`
steps are timed (CUDA synchronised each step, as the trainer's per-step collective does). Reported: tokens/s per GPU, TFLOP/s per GPU, MFU by
the project's 6N + 12·L·H·Q·T convention and by torchtitan's 6N + 6·L·H·Q·T, peak allocated memory, and where
nvidia-smi runs the mean SM clock, power draw and share of samples held back by the power limit over the timed steps.

`--variants` runs named lever combinations (see VARIANTS); `--compare-hf` adds HF Trainer + DeepSpeed with and without
Liger on the same model, seq len, micro-batch and ZeRO config. `--json` appends every result as a JSON line;
`--write-doc` writes the invocation's tables as a markdown file.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "src"
sys.path.insert(0, str(SRC))

GIB = 1024**3
from model_utils.arguments import PerfConfig  # noqa: E402  (src/ is on the path from here on)

# Each speed lever's value that leaves it off (the libraries' own behaviour), for every lever a variant does not name.
LEVERS_OFF = {"fused_kernels": "auto", "liger_kernels": "all", "flce_chunk_budget": 1, "compile": "off",
              "activation_budget": 1.0, "attention_kernel": "sdpa", "sdpa_backend": "auto", "overflow_check": "scan"}
assert set(LEVERS_OFF) == set(PerfConfig().as_dict()), "every speed lever needs its 'off' value here"


def _variant(**levers) -> dict:
    """Trainer flags for exactly `levers`: every other lever off, so each variant measures its own levers."""
    unknown = set(levers) - set(LEVERS_OFF)
    assert not unknown, f"unknown levers {sorted(unknown)}"
    return {"args": [arg for name, off in LEVERS_OFF.items() for arg in (f"--{name}", str(levers.get(name, off)))]}


# Lever combinations by name (trainer flags). `default` is the trainer's defaults as they stand; the others are the
# steps of docs/PERFORMANCE.md's lever table and the references of its loss checks.
VARIANTS = {
    "default": {},
    "liger": _variant(),                                               # all Liger kernels, eager
    "nofused": _variant(fused_kernels="off"),                          # the unoptimised path
    "compile": _variant(compile="layers", liger_kernels="flce"),       # compiled layers + Liger fused linear CE
    "cudnn": _variant(sdpa_backend="cudnn"),
    # The default path with the overflow verdict on the host: only that lever differs from "default".
    "host_overflow_check": {"args": ["--overflow_check", "norm"]},
    # The default path with attention within documents (the trainer's --document_mask); pair with --document_length.
    "document_mask": {"args": ["--document_mask"]},
    "nofused_document_mask": {"args": _variant(fused_kernels="off")["args"] + ["--document_mask"]},  # its reference
    "compile_cudnn": _variant(compile="layers", liger_kernels="flce", sdpa_backend="cudnn"),
    "fa4": _variant(compile="layers", liger_kernels="flce", attention_kernel="fa4"),
    "liger_fa4": _variant(attention_kernel="fa4"),
    "compile_norm": _variant(compile="layers", liger_kernels="flce", overflow_check="norm"),
    "compile_norm_chunk4": _variant(compile="layers", liger_kernels="flce", overflow_check="norm", flce_chunk_budget=4),
    "compile_norm_chunk8_budget90": _variant(compile="layers", liger_kernels="flce", overflow_check="norm",
                                             flce_chunk_budget=8, activation_budget=0.9),
}
# Hugging Face Trainer peers (--compare-hf): Liger on/off, and (--hf-fa4) Liger with transformers' own FA4 path.
HF_PEERS = {"noliger": {"liger": False, "attn": "sdpa"}, "liger": {"liger": True, "attn": "sdpa"},
            "liger_fa4": {"liger": True, "attn": "flash_attention_4"}}


# ----------------------------------------------------------------------------------------------------------------------
# Arithmetic (pure; tested on CPU)
# ----------------------------------------------------------------------------------------------------------------------
def throughput(tokens_per_step_per_gpu: int, step_times: list[float], flops_per_token_12: float,
               flops_per_token_6: float, peak_tflops: float | None) -> dict:
    """Per-GPU figures over the timed steps: tokens/s, TFLOP/s and MFU under both attention conventions."""
    total = sum(step_times)
    tps = tokens_per_step_per_gpu * len(step_times) / total if total > 0 else 0.0
    out = {"tokens_per_s_per_gpu": tps, "step_s_mean": total / max(len(step_times), 1),
           "step_s_median": statistics.median(step_times) if step_times else 0.0,
           "tflops_per_gpu": tps * flops_per_token_12 / 1e12, "tflops_per_gpu_6": tps * flops_per_token_6 / 1e12}
    if peak_tflops:
        out["mfu"] = out["tflops_per_gpu"] / peak_tflops
        out["mfu_6"] = out["tflops_per_gpu_6"] / peak_tflops
    return out


# nvidia-smi's clock event reason bits that mean "held back by power": the software power cap and the hardware power
# brake. `clocks_throttle_reasons` is the older field name, which newer drivers still accept.
POWER_LIMIT_BITS = 0x4 | 0x80
GPU_SAMPLE_FIELDS = "clocks.sm,power.draw,clocks_throttle_reasons.active"


def summarize_gpu_samples(lines: list[str]) -> dict:
    """nvidia-smi rows (`--format=csv,noheader,nounits` of GPU_SAMPLE_FIELDS) -> mean SM clock, mean power per GPU and
    the share of samples in which power held the clock back. Rows a GPU cannot fill ("[N/A]") are skipped."""
    clocks, powers, limited = [], [], 0
    for line in lines:
        parts = [part.strip() for part in line.split(",")]
        if len(parts) != 3:
            continue
        try:
            clock, power, reasons = float(parts[0]), float(parts[1]), int(parts[2], 16)
        except ValueError:
            continue
        clocks.append(clock)
        powers.append(power)
        limited += bool(reasons & POWER_LIMIT_BITS)
    if not clocks:
        return {}
    return {"sm_clock_mhz": statistics.fmean(clocks), "power_w": statistics.fmean(powers),
            "power_limited_share": limited / len(clocks), "gpu_samples": len(clocks)}


class GpuTelemetry:
    """SM clock, power draw and power-limit flags of the GPUs a run uses, sampled by nvidia-smi every `interval_ms`
    between start() and stop(). An H100 at its 700 W limit lowers its clock, and a step that keeps it busier runs at
    a lower clock than one with idle gaps, so throughput comparisons carry these figures. Empty without nvidia-smi."""

    def __init__(self, num_gpus: int | None = None, interval_ms: int = 100):
        """num_gpus: this host's processes of the run (torchrun's LOCAL_WORLD_SIZE; 1 for a single process)."""
        num_gpus = num_gpus or int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        ids = visible.split(",")[:num_gpus] if visible else [str(i) for i in range(num_gpus)]
        self.command = ["nvidia-smi", f"--query-gpu={GPU_SAMPLE_FIELDS}", "--format=csv,noheader,nounits",
                        "-i", ",".join(ids), "-lms", str(interval_ms)]
        self.samples = None
        self.process = None

    def start(self) -> GpuTelemetry:
        if shutil.which("nvidia-smi"):
            self.samples = tempfile.TemporaryFile(mode="w+")  # a file, not a pipe: a long window cannot fill one
            self.process = subprocess.Popen(self.command, stdout=self.samples, stderr=subprocess.DEVNULL)
        return self

    def stop(self) -> dict:
        if self.process is None:
            return {}
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:  # a hung nvidia-smi costs its figures, not the measurement
            self.process.kill()
            self.process.wait()
        self.process = None
        self.samples.seek(0)
        with self.samples:
            return summarize_gpu_samples(self.samples.read().splitlines())


def flops_per_token(config, num_params: int, seq_len: int, attention_span: float | None = None) -> tuple[float, float]:
    """Under both attention conventions. `attention_span`: the attention query-key pairs per token, seq_len unless
    attention stays within documents (then the mean over the timed tokens)."""
    from model_utils.models import FlopsModel

    fm = FlopsModel.from_config(config, num_params, seq_len)
    span = seq_len if attention_span is None else attention_span
    return fm.flops(1, span, 12), fm.flops(1, span, 6)


def normalize_env():
    from model_utils.train_utils import normalize_cuda_arch_list

    normalize_cuda_arch_list()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def ds_config_for(job: dict, path_out: Path) -> Path:
    """The job's DeepSpeed config: the named file, with an optional ZeRO stage override."""
    from model_utils.arguments import TrainConfig

    src = TrainConfig(ds_config=job.get("ds_config", "ds_config.json")).resolved_ds_config_path()
    raw = json.loads(src.read_text())
    if job.get("zero_stage") is not None:
        stage = int(job["zero_stage"])
        zero = raw.setdefault("zero_optimization", {})
        zero["stage"] = stage
        if stage < 2:
            for key in ("overlap_comm", "contiguous_gradients", "reduce_scatter", "allgather_bucket_size"):
                zero.pop(key, None)
        if stage == 0:
            raw["zero_optimization"] = {"stage": 0}
    for setting in job.get("ds_set", []):  # dotted.key=JSON value, e.g. zero_optimization.overlap_comm=false
        key, _, value = setting.partition("=")
        *parents, leaf = key.split(".")
        node = raw
        for name in parents:
            node = node.setdefault(name, {})
        node[leaf] = json.loads(value)
    path_out.write_text(json.dumps(raw, indent=2))
    return path_out


# ----------------------------------------------------------------------------------------------------------------------
# Workers (one process per GPU; rank 0 writes the result)
# ----------------------------------------------------------------------------------------------------------------------
def _sync():
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _memory() -> dict:
    import torch

    if not torch.cuda.is_available():
        return {}
    return {"peak_mem_gib": torch.cuda.max_memory_allocated() / GIB, "peak_reserved_gib": torch.cuda.max_memory_reserved() / GIB}


GPU_EVENT_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def gpu_idle_report(events: list[dict], min_gap_us: float = 20.0, top: int = 15) -> str:
    """Where the GPU waited, from a torch.profiler (Kineto) trace's events: idle time between GPU activity, summed by
    the phase (`phase:NAME` annotation) the host was in when the GPU ran dry, and the longest gaps with the host
    operator running at their start (what the GPU waited for) and the one that launched the kernel ending them."""
    gpu = sorted((e["ts"], e["ts"] + e.get("dur", 0), e) for e in events
                 if e.get("ph") == "X" and e.get("cat") in GPU_EVENT_CATEGORIES)
    if not gpu:
        return "gpu idle: no GPU events in the trace"
    cpu_ops = [e for e in events if e.get("ph") == "X" and e.get("cat") == "cpu_op"]
    phases = [e for e in events if e.get("ph") == "X" and e.get("cat") == "user_annotation"
              and str(e.get("name", "")).startswith("phase:")]
    launches = {e.get("args", {}).get("correlation"): e for e in events
                if e.get("ph") == "X" and e.get("cat") in ("cuda_runtime", "cuda_driver")}  # Triton: cuLaunchKernelEx

    def active(pool, t):  # the innermost (latest-starting) event of `pool` running at time t
        running = [e for e in pool if e["ts"] <= t < e["ts"] + e.get("dur", 0)]
        return max(running, key=lambda e: e["ts"]) if running else None

    gaps, end = [], gpu[0][1]
    for start, stop, event in gpu[1:]:
        if start - end >= min_gap_us:
            gaps.append((end, start, event))
        end = max(end, stop)
    window = end - gpu[0][0]
    by_phase: dict[str, float] = {}
    for t0, t1, _ in gaps:
        phase = active(phases, t0)
        name = phase["name"][len("phase:"):] if phase else "between phases"
        by_phase[name] = by_phase.get(name, 0.0) + (t1 - t0)
    idle = sum(t1 - t0 for t0, t1, _ in gaps)
    lines = [f"gpu idle: {idle / 1e3:.1f} ms of {window / 1e3:.1f} ms ({100 * idle / window:.1f}%) in {len(gaps)} gaps "
             f">= {min_gap_us:.0f} us; by the host's phase at the gap's start: "
             + ", ".join(f"{k} {v / 1e3:.1f} ms" for k, v in sorted(by_phase.items(), key=lambda kv: -kv[1]))]
    for t0, t1, next_event in sorted(gaps, key=lambda g: g[0] - g[1])[:top]:
        host = active(cpu_ops, t0)
        launch = launches.get(next_event.get("args", {}).get("correlation"))
        launcher = active(cpu_ops, launch["ts"]) if launch else None
        lines.append(f"  {(t1 - t0) / 1e3:7.2f} ms at +{(t0 - gpu[0][0]) / 1e3:8.1f} ms: host in "
                     f"{host['name'] if host else '-'}; ended by {next_event.get('name', '?')[:60]} launched from "
                     f"{launcher['name'] if launcher else '-'}")
    return "\n".join(lines)


def profile_steps(step, is_main: bool, steps: int = 2, trace: str | None = None) -> None:
    """Where a step's time goes, printed by rank 0 into the measurement's log. `step(phase)` runs one training step
    (the trainer's train_step), entering `phase(name)` around each micro-batch's forward, backward and optimizer
    step. First three steps with every phase synchronised: the time until its call returns (host: Python, launches)
    against the time until the GPU is done, so a phase whose host time is the larger starves the GPU. Then `steps`
    steps under torch.profiler: kernels by GPU time, operators by host time, and where the GPU waited
    (gpu_idle_report); with `trace`, the Chrome trace is written there (gzip)."""
    import contextlib

    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    names = ("forward", "backward", "step")
    host, total = {name: [] for name in names}, {name: [] for name in names}

    @contextlib.contextmanager
    def synchronised(name):
        _sync()
        t0 = time.perf_counter()
        yield
        t1 = time.perf_counter()
        _sync()
        host[name].append(t1 - t0)
        total[name].append(time.perf_counter() - t0)

    for _ in range(3):
        step(synchronised)
    if is_main:
        print("phase timing (median of 3 synchronised steps): host = until the call returns, total = until the GPU "
              "is done", flush=True)
        for name in names:
            print(f"  {name:10s} host {1e3 * statistics.median(host[name]):8.1f} ms   "
                  f"total {1e3 * statistics.median(total[name]):8.1f} ms", flush=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step(lambda name: record_function(f"phase:{name}"))
        _sync()
    if is_main:
        import gzip

        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "trace.json"
            prof.export_chrome_trace(str(path))
            raw = path.read_bytes()
        print(gpu_idle_report(json.loads(raw).get("traceEvents", [])), flush=True)
        if trace:
            Path(trace).parent.mkdir(parents=True, exist_ok=True)
            Path(trace).write_bytes(gzip.compress(raw))
        events = prof.key_averages()
        keys = (["self_device_time_total"] if torch.cuda.is_available() else []) + ["self_cpu_time_total", "cpu_time_total"]
        for key in keys:
            print(f"profile over {steps} steps, sorted by {key}:", flush=True)
            print(events.table(sort_by=key, row_limit=40, max_name_column_width=90), flush=True)


def end_documents(tokens, mean_length: int, eos_id: int, seed: int) -> None:
    """Turn random tokens into documents: an EOS after every ~mean_length tokens (geometric lengths), in place."""
    import numpy as np

    rng = np.random.default_rng(seed)
    ends = np.cumsum(rng.geometric(1 / mean_length, size=len(tokens) // mean_length * 2 + 16)) - 1
    tokens[ends[ends < len(tokens)]] = eos_id


def worker_engine(job: dict, workdir: Path) -> dict:
    normalize_env()
    import torch

    from model_utils.models import gpu_peak_tflops
    from model_utils.train_utils import distributed_env_problems, setup_distributed
    from train_deepspeed import agree_after_step, parse_args, setup, train_step

    steps, warmup = job["steps"], job["warmup"]
    total = steps + warmup
    argv = ["--model", job["model"], "--max_steps", str(total), "--dummy_data", str(job["dummy_blocks"]),
            "--ds_config", str(ds_config_for(job, workdir / "ds_config.json")),
            "--checkpoint_dir", str(workdir / "ckpt"), "--resume", "never", "--eval_interval", "0",
            "--checkpoint_freq", "0", "--no-export", "--log_interval", str(10**6),
            "--seed", str(job.get("seed", 1234))]
    if job.get("seq_len"):
        argv += ["--seq_len", str(job["seq_len"])]
    if job.get("micro_batch_size"):
        argv += ["--micro_batch_size", str(job["micro_batch_size"])]
    if job.get("warmup_steps") is not None:
        argv += ["--warmup_steps", str(job["warmup_steps"])]
    if job.get("gradient_checkpointing"):
        argv += ["--gradient_checkpointing"]
    cfg = parse_args(argv + job.get("args", []))
    assert not distributed_env_problems()
    dist = setup_distributed()
    t0 = time.perf_counter()
    run = setup(cfg, dist)
    setup_s = time.perf_counter() - t0
    if job.get("document_length"):
        end_documents(run.data.train.tokens, job["document_length"], run.tokenizer.eos_token_id, job.get("seed", 1234))
    engine = run.engine
    engine.train()

    def step(phase=None):
        """The trainer's own step and its per-step collective (which books an update the GPU skipped)."""
        result = train_step(run, phase) if phase else train_step(run)
        agree_after_step(run, result)
        return result

    times, losses, timed_area = [], [], 0
    telemetry = GpuTelemetry()  # rank 0 samples every GPU of its host
    for i in range(total):  # peak memory is kept over the whole run: warm-up steps allocate the same buffers
        if i == warmup and dist.is_main:
            telemetry.start()
        _sync()
        t = time.perf_counter()
        result = step()
        _sync()
        dt = time.perf_counter() - t
        losses.append(result.loss_sum.item() / run.grad_accum)  # this rank's mean over its micro-batches
        if i >= warmup:
            times.append(dt)
            timed_area += result.attention_area  # the timed steps' attention pairs (FLOPs), for rank 0's blocks
        if dist.is_main and job.get("verbose"):
            print(f"  step {i}: {dt * 1e3:.1f} ms, loss {losses[-1]:.4f}", flush=True)
    gpu = telemetry.stop()
    if job.get("profile"):
        profile_steps(step, dist.is_main, trace=job.get("trace"))
    config = engine.module.config
    num_params = sum(getattr(p, "ds_numel", p.numel()) for p in engine.module.parameters())
    tokens_per_step = run.batch.tokens_per_rank_step  # per GPU
    f12, f6 = flops_per_token(config, num_params, run.seq_len, timed_area / (tokens_per_step * steps) if steps else None)
    peak = gpu_peak_tflops(torch.cuda.get_device_name()) if torch.cuda.is_available() else None
    result = {"kind": "engine", "world_size": dist.world_size, "setup_s": setup_s, "losses": losses,
              "num_params": num_params, "micro_batch_size": run.micro_batch, "seq_len": run.seq_len,
              "zero_stage": run.ds_config.get("zero_optimization", {}).get("stage", 0),
              **throughput(tokens_per_step, times, f12, f6, peak), **_memory(), **gpu}
    mem = torch.tensor([result.get("peak_mem_gib", 0.0)], device=dist.device)
    dist.all_reduce(mem, torch.distributed.ReduceOp.MAX)
    if "peak_mem_gib" in result:
        result["peak_mem_gib"] = float(mem.item())
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return result if dist.is_main else None


def hf_ds_config(job: dict, workdir: Path) -> dict:
    """The same DeepSpeed config, with the values HF Trainer fills from TrainingArguments set to "auto"."""
    raw = json.loads(ds_config_for(job, workdir / "ds_config.json").read_text())
    ds = copy.deepcopy(raw)
    for key in ("train_micro_batch_size_per_gpu", "train_batch_size", "gradient_accumulation_steps",
                "gradient_clipping"):
        ds[key] = "auto"
    ds["bf16"] = {"enabled": "auto"}
    params = ds.get("optimizer", {}).get("params", {})
    for key in ("lr", "betas", "eps", "weight_decay"):
        if key in params:
            params[key] = "auto"
    sched = ds.get("scheduler", {}).get("params", {})
    for key in ("total_num_steps", "warmup_num_steps"):
        if key in sched:
            sched[key] = "auto"
    ds.pop("_comment", None)
    return ds


def worker_hf(job: dict, workdir: Path) -> dict:
    normalize_env()
    from model_utils.train_utils import distributed_env_problems

    assert not distributed_env_problems()  # a single process gets RANK/WORLD_SIZE/MASTER_* like the trainer's
    import numpy as np
    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from model_utils.concat_dataset import dummy_packed
    from model_utils.models import build_model, gpu_peak_tflops, model_config
    from model_utils.tokenizer import load_tokenizer

    steps, warmup, mb = job["steps"], job["warmup"], job["micro_batch_size"]
    from model_utils.models import default_seq_len

    seq_len = job["seq_len"] or default_seq_len(job["model"])
    tokenizer = load_tokenizer(None)
    mconf = model_config(job["model"], tokenizer)
    data = dummy_packed(job["dummy_blocks"], seq_len, len(tokenizer), job.get("seed", 1234))
    blocks = [np.asarray(data.train.batch([i]))[0] for i in data.train_ids]

    class Blocks(torch.utils.data.Dataset):
        def __len__(self):
            return len(blocks)

        def __getitem__(self, i):
            ids = torch.as_tensor(blocks[i][:seq_len].astype(np.int64))
            return {"input_ids": ids, "labels": ids.clone()}  # HF shifts the labels itself

    cuda = torch.cuda.is_available()
    ds = hf_ds_config(job, workdir)
    opt = json.loads((workdir / "ds_config.json").read_text()).get("optimizer", {}).get("params", {})
    args = TrainingArguments(
        output_dir=str(workdir / "hf"), per_device_train_batch_size=mb, gradient_accumulation_steps=1,
        max_steps=steps + warmup, learning_rate=opt.get("lr", 3e-4), weight_decay=opt.get("weight_decay", 0.0),
        adam_beta1=opt.get("betas", [0.9, 0.999])[0], adam_beta2=opt.get("betas", [0.9, 0.999])[1],
        adam_epsilon=opt.get("eps", 1e-8), max_grad_norm=1.0, warmup_steps=1, bf16=cuda, deepspeed=ds,
        use_liger_kernel=bool(job.get("liger")), logging_steps=10**6, save_strategy="no", report_to="none",
        disable_tqdm=True, seed=job.get("seed", 1234), dataloader_num_workers=2 if cuda else 0,
        use_cpu=not cuda)
    model = build_model(job["model"], mconf, torch.float32, job.get("attn", "sdpa"), False)

    rank = int(os.environ.get("RANK", "0"))
    telemetry = GpuTelemetry()

    class Timer(TrainerCallback):
        def __init__(self):
            self.times, self.t, self.gpu = [], None, {}

        def on_step_begin(self, a, state, control, **kw):
            if len(self.times) == warmup and rank == 0:
                telemetry.start()
            _sync()
            self.t = time.perf_counter()

        def on_step_end(self, a, state, control, **kw):
            _sync()
            self.times.append(time.perf_counter() - self.t)
            if len(self.times) == warmup + steps:  # the last timed step: Trainer's wind-down is not sampled
                self.gpu = telemetry.stop()

    timer = Timer()
    trainer = Trainer(model=model, args=args, train_dataset=Blocks(), callbacks=[timer])
    trainer.train()
    gpu = timer.gpu or telemetry.stop()
    world = args.world_size
    num_params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    f12, f6 = flops_per_token(mconf, num_params, seq_len)
    peak = gpu_peak_tflops(torch.cuda.get_device_name()) if cuda else None
    times = timer.times[warmup:]
    result = {"kind": "hf", "liger": bool(job.get("liger")), "attn": job.get("attn", "sdpa"), "world_size": world, "num_params": num_params,
              "micro_batch_size": mb, "seq_len": seq_len,
              **throughput(mb * seq_len, times, f12, f6, peak), **_memory(), **gpu}
    return result if rank == 0 else None


def worker_main(job_json: str, result_path: str) -> int:
    job = json.loads(job_json)
    with tempfile.TemporaryDirectory(prefix="bench-") as tmp:
        workdir = Path(tmp)
        if job["kind"] == "engine":
            result = worker_engine(job, workdir)
        else:
            result = worker_hf(job, workdir)
    if result is not None:
        Path(result_path).write_text(json.dumps(result))
    return 0


# ----------------------------------------------------------------------------------------------------------------------
# Driver
# ----------------------------------------------------------------------------------------------------------------------
def gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:  # noqa: BLE001
        return 0


def run_job(job: dict, nproc: int, timeout: int, log_dir: Path | None) -> dict:
    """Run one measurement in fresh processes; return its result or {'error': ...}."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        result_path = f.name
    os.unlink(result_path)
    me = str(Path(__file__).resolve())
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", me]
    else:
        cmd = [sys.executable, me]
    cmd += ["--worker", json.dumps(job), "--result", result_path]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    t0 = time.perf_counter()
    log_path = (log_dir / f"{job['name']}.log") if log_dir else None
    try:
        out = subprocess.run(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             timeout=timeout)
        text, rc = out.stdout, out.returncode
    except subprocess.TimeoutExpired as e:
        text, rc = (e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")) + "\n[timeout]", -9
    if log_path:
        log_path.write_text(text)
    wall = time.perf_counter() - t0
    if rc == 0 and os.path.exists(result_path):
        result = json.loads(Path(result_path).read_text())
        os.unlink(result_path)
        result["wall_s"] = wall
        return result
    tail = "\n".join(text.strip().splitlines()[-15:])
    reason = "out of memory" if "out of memory" in text.lower() or "OutOfMemoryError" in text else f"exit {rc}"
    return {"error": reason, "tail": tail, "wall_s": wall}


def run_jobs(jobs: list[dict], run, report) -> list[dict]:
    """Run the jobs in order; once a run goes out of memory at a micro-batch, that run's larger micro-batches are
    skipped (they cannot fit either), so a sweep spends no device time on them."""
    results, out_of_memory_at = [], {}  # variant -> the smallest micro-batch that ran out of memory
    for job in jobs:
        mb, oom_mb = job.get("micro_batch_size") or 0, out_of_memory_at.get(job["variant"])
        r = {"error": f"skipped (out of memory at {oom_mb})"} if oom_mb is not None and mb > oom_mb else run(job)
        if r.get("error") == "out of memory" and mb:
            out_of_memory_at[job["variant"]] = min(mb, oom_mb or mb)
        results.append(r)
        report(job, r)
    return results


def _ds_set_suffix(items: list[str]) -> str:
    """`-overlap_comm-false` for zero_optimization.overlap_comm=false: the key's last part and the value."""
    parts = [item.partition("=") for item in items]
    return "".join(f"-{key.rsplit('.', 1)[-1]}-{value}" for key, _, value in parts)


def make_jobs(a) -> list[dict]:
    """The runs of one invocation: per micro-batch the engine variants (and the HF peers at theirs), `--rounds` times
    in turn (names end in -r1, -r2... from two rounds on), then the loss check once."""
    base = {"model": a.model, "seq_len": a.seq_len, "steps": a.steps, "warmup": a.warmup, "seed": a.seed,
            "ds_config": a.ds_config, "zero_stage": a.zero_stage, "gradient_checkpointing": a.gradient_checkpointing,
            "profile": a.profile, "ds_set": a.ds_set, "document_length": a.document_length}

    def traced(job: dict) -> dict:  # --profile --trace: the run's Chrome trace, named after the run
        if a.trace and job.get("profile"):
            job["trace"] = str(Path(a.trace).resolve() / f"{job['name']}.json.gz")
        return job

    def engine(v: str, name: str, **fields) -> dict:
        spec = VARIANTS[v]
        return traced(dict(base, kind="engine", args=spec.get("args", []), name=name, variant=v, **fields))

    def blocks(mb) -> int:
        return max(64, (a.steps + a.warmup + 2) * (mb or 16) * a.nproc + 8)

    ours = a.micro_batch_size or [None]
    peers = ours if a.hf_micro_batch_size is None else a.hf_micro_batch_size
    one_round = []
    suffix = (f"-z{a.zero_stage}" if a.zero_stage is not None else "") + _ds_set_suffix(a.ds_set)
    for mb in ours + [mb for mb in peers if mb not in ours]:
        if mb in ours:
            one_round += [engine(v, f"engine-{v}-mb{mb}{suffix}", micro_batch_size=mb, dummy_blocks=blocks(mb))
                          for v in a.variants]
        if a.compare_hf and mb in peers:
            for peer, spec in HF_PEERS.items():
                if peer in a.hf_skip or (peer == "liger_fa4" and not a.hf_fa4):
                    continue
                one_round.append(dict(base, kind="hf", micro_batch_size=mb or 8, dummy_blocks=blocks(mb), **spec,
                                      name=f"hf-{peer}-mb{mb}", variant="hf+" + peer.replace("_", "+")))
    jobs = one_round if a.rounds == 1 else [traced(dict(job, name=f"{job['name']}-r{k}", round=k))
                                            for k in range(1, a.rounds + 1) for job in one_round]
    if a.loss_check:
        ref = a.loss_check_reference
        for v in [ref] + [x for x in a.loss_check_variants if x != ref]:
            jobs.append(engine(v, f"losscheck-{v}-mb{a.loss_check_mb}", steps=a.loss_check, warmup=0, profile=False,
                               micro_batch_size=a.loss_check_mb,
                               dummy_blocks=(a.loss_check + 1) * a.loss_check_mb * a.nproc + 8))
    return jobs


def versions() -> dict:
    from model_utils.monitor import package_version

    out = {"python": platform.python_version()}
    for name in ("torch", "deepspeed", "transformers", "liger-kernel", "flash-attn-4", "triton", "accelerate"):
        out[name] = package_version(name)
    try:
        import torch

        if torch.cuda.is_available():
            out["gpu"] = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name()}"
            out["cuda"] = torch.version.cuda
    except Exception:  # noqa: BLE001
        pass
    return out


def fmt_row(job: dict, r: dict, ref: dict | None) -> str:
    name = job["name"]
    if "error" in r:
        return f"| {name} | {job.get('micro_batch_size')} | {r['error']} | | | | | | | |"
    mfu = f"{100 * r['mfu']:.1f}%" if "mfu" in r else "-"
    mfu6 = f"{100 * r['mfu_6']:.1f}%" if "mfu_6" in r else "-"
    mem = f"{r['peak_mem_gib']:.1f}" if "peak_mem_gib" in r else "-"
    ratio = f"{r['tokens_per_s_per_gpu'] / ref['tokens_per_s_per_gpu']:.2f}x" if ref and "error" not in ref else "-"
    gpu = (f"{r['sm_clock_mhz']:,.0f} / {r['power_w']:.0f} / {100 * r['power_limited_share']:.0f}%"
           if "sm_clock_mhz" in r else "-")
    return (f"| {name} | {r['micro_batch_size']} | {r['tokens_per_s_per_gpu']:,.0f} | {r['tflops_per_gpu']:.0f} | "
            f"{mfu} | {mfu6} | {mem} | {1e3 * r['step_s_median']:.0f} | {gpu} | {ratio} |")


def is_hf_liger_peer(job: dict) -> bool:
    """The peer the ratios are to: HF Trainer + DeepSpeed + Liger with SDPA attention."""
    return job.get("kind") == "hf" and bool(job.get("liger")) and job.get("attn", "sdpa") == "sdpa"


def micro_batch(job: dict, result: dict):
    """The micro-batch a run used: the worker's report (ds_config's when the job named none), else the job's."""
    return result.get("micro_batch_size", job.get("micro_batch_size"))


def table(jobs: list[dict], results: list[dict], ref_name: str | None) -> str:
    """One row per run. The ratio is to HF + Liger at the same micro-batch in the same round ("-" where that did not
    run: the best micro-batch each is best_per_side's line); without any HF + Liger run, to `ref_name`."""
    by_name = {j["name"]: r for j, r in zip(jobs, results)}
    same_mb = {(j.get("round"), micro_batch(j, r)): r for j, r in zip(jobs, results)
               if is_hf_liger_peer(j) and "error" not in r}
    lines = ["| run | micro-batch | tokens/s/GPU | TFLOP/s/GPU | MFU (12·LHQT) | MFU (6·LHQT) | peak GiB | step ms "
             "| SM MHz / W / power-limited "
             f"| vs {'HF + Liger, same micro-batch' if same_mb else ref_name or '-'} |", "|---|---|---|---|---|---|---|---|---|---|"]
    lines += [fmt_row(j, r, same_mb.get((j.get("round"), micro_batch(j, r))) if same_mb else by_name.get(ref_name))
              for j, r in zip(jobs, results)]
    return "\n".join(lines)


def _best_each(rows: list[tuple[dict, dict]]) -> dict | None:
    """Each side's fastest micro-batch among `rows` (job, result) and its tokens/s: the mean over the rows that ran
    at that micro-batch (one per round)."""
    def best(pick):
        by_mb = {}
        for j, r in rows:
            if pick(j) and "error" not in r:
                by_mb.setdefault(micro_batch(j, r), []).append(r["tokens_per_s_per_gpu"])
        return max(((statistics.mean(v), mb) for mb, v in by_mb.items()), default=None)

    ours = best(lambda j: j["kind"] == "engine" and j.get("variant") == "default")
    peer = best(is_hf_liger_peer)
    if not ours or not peer:
        return None
    failed = sorted({j["micro_batch_size"] for j, r in rows if "error" in r and is_hf_liger_peer(j)})
    return {"ours": ours, "peer": peer, "failed": failed, "ratio": ours[0] / peer[0]}


def best_per_side(jobs: list[dict], results: list[dict]) -> str:
    """With several micro-batches: each side at its fastest micro-batch that ran, and the ratio (the issue's measure).
    With --rounds, the same per round, then over all rounds by each side's mean tokens/s at its best micro-batch."""
    rows = list(zip(jobs, results))
    if len({micro_batch(j, r) for j, r in rows}) < 2:
        return ""

    def line(b: dict, digits: int = 2) -> str:
        return (f"default path {b['ours'][0]:,.0f} tokens/s at {b['ours'][1]}, HF + Liger {b['peer'][0]:,.0f} at "
                f"{b['peer'][1]}" + (f" (failed at {b['failed']})" if b["failed"] else "")
                + f": {b['ratio']:.{digits}f}x")

    overall = _best_each(rows)
    rounds = sorted({j["round"] for j in jobs if "round" in j})
    if not overall or not rounds:
        return "Best micro-batch each: " + line(overall) if overall else ""
    per_round = {k: _best_each([(j, r) for j, r in rows if j.get("round") == k]) for k in rounds}
    out = [f"Round {k}, best micro-batch each: " + (line(b, 3) if b else "no pair ran") for k, b in per_round.items()]
    ratios = [b["ratio"] for b in per_round.values() if b]
    if ratios:
        out.append(f"Over {len(rounds)} rounds, each side's mean at its best micro-batch: {line(overall, 3)} "
                   f"(rounds {min(ratios):.3f}x-{max(ratios):.3f}x, median {statistics.median(ratios):.3f}x)")
    return "\n".join(out)


def loss_check(results_a: dict, results_b: dict, n: int = 50) -> dict:
    """Max and mean |difference| of per-step losses between two runs (same seed/data), first n steps."""
    a, b = results_a.get("losses", [])[:n], results_b.get("losses", [])[:n]
    k = min(len(a), len(b))
    if k == 0:
        return {}
    diffs = [abs(x - y) for x, y in zip(a[:k], b[:k])]
    return {"steps": k, "max_abs_diff": max(diffs), "mean_abs_diff": sum(diffs) / k, "first": (a[0], b[0]),
            "last": (a[k - 1], b[k - 1])}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-0.6b")
    p.add_argument("--seq_len", type=int, default=None, help="default: the preset's (4096 for Qwen3)")
    p.add_argument("--micro_batch_size", type=int, nargs="*", default=None, help="one or more; default: ds_config's")
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    p.add_argument("--warmup", type=int, default=3, help="untimed warm-up steps (compilation, allocator)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--ds_config", default="ds_config.json")
    p.add_argument("--zero_stage", type=int, default=None, help="override the config's ZeRO stage")
    p.add_argument("--gradient_checkpointing", action="store_true")
    p.add_argument("--document_length", type=int, default=0, metavar="N",
                   help="end a document (EOS) every ~N tokens of the random data, for the document_mask variant; "
                        "applies to every engine variant of the invocation (0: no documents)")
    p.add_argument("--ds-set", dest="ds_set", nargs="*", default=[], metavar="KEY=JSON",
                   help="override DeepSpeed config values, e.g. zero_optimization.overlap_comm=false")
    p.add_argument("--variants", nargs="*", default=["default"], choices=list(VARIANTS))
    p.add_argument("--compare-hf", dest="compare_hf", action="store_true")
    p.add_argument("--hf-skip", dest="hf_skip", nargs="*", default=[], choices=list(HF_PEERS))
    p.add_argument("--hf-micro-batch-size", dest="hf_micro_batch_size", type=int, nargs="*", default=None,
                   help="the HF peers' micro-batches (default: --micro_batch_size's), e.g. each side at its best")
    p.add_argument("--rounds", type=int, default=1,
                   help="run the invocation's measurements N times in turn, so both sides share the GPU's thermal and "
                        "power state; ratios per round and over all rounds")
    p.add_argument("--hf-fa4", dest="hf_fa4", action="store_true",
                   help="also run HF Trainer + Liger with attn_implementation=flash_attention_4 (needs flash-attn-4)")
    p.add_argument("--profile", action="store_true",
                   help="engine runs: profile two steps after the timed ones and print the top kernels (in the log)")
    p.add_argument("--trace", default=None, metavar="DIR",
                   help="with --profile: also write each engine run's Chrome trace to DIR/NAME.json.gz")
    p.add_argument("--nproc", type=int, default=None, help="GPUs to use (default: all present; 1 on CPU)")
    p.add_argument("--timeout", type=int, default=900, help="seconds per measurement")
    p.add_argument("--loss-check", dest="loss_check", type=int, default=0,
                   help="also run N steps of the unoptimised path (--fused_kernels off, no compile) and of the "
                        "default path at --loss-check-mb, same seed/data, and compare the losses")
    p.add_argument("--loss-check-mb", dest="loss_check_mb", type=int, default=2)
    p.add_argument("--loss-check-variants", dest="loss_check_variants", nargs="*", default=["default"],
                   choices=list(VARIANTS))
    p.add_argument("--loss-check-reference", dest="loss_check_reference", default="nofused",
                   choices=["nofused", "nofused_document_mask"], help="the unoptimised path the losses are compared to")
    p.add_argument("--json", default=None, help="append results (JSON lines) to this file")
    p.add_argument("--log-dir", dest="log_dir", default=None, help="full log of every measurement")
    p.add_argument("--write-doc", dest="write_doc", default=None, help="write this markdown section file")
    p.add_argument("--title", default=None)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.rounds < 1:
        p.error(f"--rounds {a.rounds}: give 1 or more")
    if a.worker:
        return worker_main(a.worker, a.result)

    normalize_env()
    a.nproc = a.nproc or max(gpu_count(), 1)
    log_dir = Path(a.log_dir) if a.log_dir else None
    if log_dir:
        log_dir.mkdir(parents=True, exist_ok=True)
    jobs = make_jobs(a)
    vers = versions()
    command = "python benchmarks/bench.py " + " ".join(shlex.quote(x) for x in (argv if argv is not None else sys.argv[1:]))
    print(f"# {command}\n# {json.dumps(vers)}", flush=True)

    def report(job, r):
        short = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items() if k not in ("losses", "tail")}
        print(f"{job['name']}: {json.dumps(short)}", flush=True)
        if "tail" in r:
            print(r["tail"], flush=True)
        if a.json:
            with open(a.json, "a") as f:
                f.write(json.dumps({"job": job, "result": r, "versions": vers, "nproc": a.nproc, "command": command}) + "\n")

    results = run_jobs(jobs, lambda job: run_job(job, a.nproc, a.timeout, log_dir), report)
    perf = [(j, r) for j, r in zip(jobs, results) if not j["name"].startswith("losscheck")]
    ref_name = next((j["name"] for j, r in perf if is_hf_liger_peer(j) and "error" not in r), None)
    text = table([j for j, _ in perf], [r for _, r in perf], ref_name)
    best = best_per_side([j for j, _ in perf], [r for _, r in perf])
    if best:
        text += "\n\n" + best
    lc = None
    if a.loss_check:
        la = next(r for j, r in zip(jobs, results) if j["name"].startswith(f"losscheck-{a.loss_check_reference}-"))
        for v in a.loss_check_variants:
            lb = next(r for j, r in zip(jobs, results) if j["name"].startswith(f"losscheck-{v}-"))
            lc = loss_check(la, lb, a.loss_check)
            text += (f"\n\nLoss check ({a.loss_check} steps, mb {a.loss_check_mb}, same seed/data): unoptimised path "
                     f"(`{a.loss_check_reference}`: --fused_kernels off, eager) vs `{v}`: {json.dumps(lc)}")
    print("\n" + text, flush=True)
    if a.write_doc:
        title = a.title or f"{a.model}, {a.nproc} GPU(s)"
        body = [f"### {title}", "", f"Hardware/versions: `{json.dumps(vers)}`", "", f"Command: `{command}`", "", text, ""]
        Path(a.write_doc).write_text("\n".join(body))
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
