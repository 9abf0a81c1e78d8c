#!/usr/bin/env python3
"""Training throughput benchmark on the project's real path, optionally against HF Trainer + DeepSpeed (+ Liger).

    python benchmarks/bench.py --model qwen3-0.6b --seq_len 4096 --micro_batch_size 8 --steps 10 --compare-hf
    python benchmarks/bench.py --model tiny --steps 2 --warmup 1            # CPU smoke run

Every measurement runs in its own process (fresh CUDA memory statistics, no monkey-patch leaking between variants), on
all GPUs present (torchrun --standalone) unless --nproc says otherwise. The engine path is the trainer's own:
`parse_args` -> `make_plan` -> `build_run` (model, speed options, DeepSpeed engine from ds_config.json) -> `train_step`
and the loop's per-step collective (`agree_after_step`), on `--dummy_data` random token blocks. After `--warmup` steps,
`--steps` steps are timed (CUDA synchronised each step, as the trainer's per-step collective does). Reported: tokens/s
per GPU, TFLOP/s per GPU, MFU by the project's 6N + 12·L·H·Q·T convention and by torchtitan's 6N + 6·L·H·Q·T, peak
allocated memory, and where nvidia-smi runs the mean SM clock, power draw and share of samples held back by the power
limit over the timed steps.

`--variants` runs named lever combinations (see VARIANTS); `--compare-hf` adds HF Trainer + DeepSpeed with and without
Liger on the same model, seq len, micro-batch and ZeRO config. `--json` appends every result as a JSON line;
`--write-doc` writes the invocation's tables as a markdown file.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# The benchmark's own modules sit beside this script: common (shared setup), telemetry (nvidia-smi sampling), profiling
# (--profile), hf_peer (the HF Trainer peer) and report (figures and tables). The script's folder is put on the path
# explicitly, so every worker process finds them also where Python would not add it (PYTHONSAFEPATH).
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, cuda_sync, ds_config_for, host_peak_gib, normalize_env, peak_memory  # noqa: E402
from hf_peer import HF_PEERS, worker_hf  # noqa: E402
from profiling import profile_steps  # noqa: E402
from report import base_parameters, best_per_side, flops_per_token, is_hf_liger_peer, loss_check, table, throughput, versions  # noqa: E402
from telemetry import GpuTelemetry  # noqa: E402

from model_utils.config.settings import SpeedConfig  # noqa: E402  (importable once common is imported)

# Each speed lever's value that leaves it off (the libraries' own behaviour), for every lever a variant does not name.
LEVERS_OFF = {"fused_kernels": "auto", "liger_kernels": "all", "flce_chunk_budget": 1, "compile": "off",
              "activation_budget": 1.0, "attention_kernel": "sdpa", "sdpa_backend": "auto", "overflow_check": "scan",
              "delayed_update_prefetch": "off"}
assert set(LEVERS_OFF) == set(SpeedConfig().as_dict()), "every speed lever needs its 'off' value here"


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
    # The default path with ZeRO offload's update delayed by one step from the first (the trainer's
    # --delayed_update_from_step); pair with an offload config.
    "delayed_update": {"args": ["--delayed_update_from_step", "1"]},
    # ...without the prefetch of each update's weights to a second GPU buffer (ZeRO-1/2: --delayed_update_prefetch)
    "delayed_update_no_prefetch": {"args": ["--delayed_update_from_step", "1", "--delayed_update_prefetch", "off"]},
    # ...and with --gradient_checkpointing, only as many layers recomputed as the GPU needs (--checkpointed_layers
    # auto).
    "delayed_update_auto_layers": {"args": ["--delayed_update_from_step", "1", "--checkpointed_layers", "auto"]},
    # The default path with eager decoder layers (what ZeRO-3 runs with the parameters offloaded or LoRA's adapters).
    "eager_layers": {"args": ["--compile", "off"]},
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


# ----------------------------------------------------------------------------------------------------------------------
# Workers (one process per GPU; rank 0 writes the result)
# ----------------------------------------------------------------------------------------------------------------------
def end_documents(tokens, mean_length: int, eos_id: int, seed: int) -> None:
    """Turn random tokens into documents: an EOS after every ~mean_length tokens (geometric lengths), in place."""
    import numpy as np

    rng = np.random.default_rng(seed)
    ends = np.cumsum(rng.geometric(1 / mean_length, size=len(tokens) // mean_length * 2 + 16)) - 1
    tokens[ends[ends < len(tokens)]] = eos_id


def worker_engine(job: dict, workdir: Path) -> dict:
    normalize_env()
    import torch

    from model_utils.config.flags import parse_args
    from model_utils.models.build import gpu_peak_tflops
    from model_utils.planning.plan import make_plan
    from model_utils.planning.preflight import check_plan, raise_on_problems
    from model_utils.runtime.distributed import distributed_env_problems, setup_distributed
    from model_utils.train.build import build_run, start_log
    from model_utils.train.step import agree_after_step, train_step

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
    if job.get("global_batch_tokens"):  # the trainer derives the accumulation (and, with no micro-batch, chooses one)
        argv += ["--global_batch_tokens", str(job["global_batch_tokens"])]
    if job.get("warmup_steps") is not None:
        argv += ["--warmup_steps", str(job["warmup_steps"])]
    if job.get("gradient_checkpointing"):
        argv += ["--gradient_checkpointing"]
    cfg = parse_args(argv + job.get("args", []))
    assert not distributed_env_problems()
    dist = setup_distributed()
    t0 = time.perf_counter()
    # A benchmark run never saves (train_step only), so the preflight's disk check for checkpoints does not apply
    # (Qwen3-8B's ~112 GiB checkpoint against a 64 GiB disk would stop the run it does not concern). Every rank plans
    # alike: a fresh directory (--resume never) and random blocks leave nothing for one rank to decide.
    log = start_log(cfg, dist)
    plan = make_plan(cfg, dist.world_size, on_training_hardware=True)
    raise_on_problems(check_plan(plan, check_data=False, check_disk=False))
    run = build_run(plan, dist, log)
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
        cuda_sync()
        t = time.perf_counter()
        result = step()
        cuda_sync()
        dt = time.perf_counter() - t
        losses.append(result.loss_sum.item() / run.batch.accumulation)  # this rank's mean over its micro-batches
        if i >= warmup:
            times.append(dt)
            timed_area += result.attention_area  # the timed steps' attention pairs (FLOPs), for rank 0's blocks
        if dist.is_main and job.get("verbose"):
            print(f"  step {i}: {dt * 1e3:.1f} ms, loss {losses[-1]:.4f}", flush=True)
    gpu = telemetry.stop()
    if job.get("profile"):
        profile_steps(step, dist.is_main, trace=job.get("trace"))
    config = engine.module.config
    num_params = base_parameters(engine.module)
    tokens_per_step = run.batch.tokens_per_rank_step  # per GPU
    f12, f6 = flops_per_token(config, num_params, run.batch.seq_len, timed_area / (tokens_per_step * steps) if steps else None)
    peak = gpu_peak_tflops(torch.cuda.get_device_name()) if torch.cuda.is_available() else None
    result = {"kind": "engine", "world_size": dist.world_size, "setup_s": setup_s, "losses": losses,
              "num_params": num_params, "micro_batch_size": run.batch.micro, "seq_len": run.batch.seq_len,
              "gradient_accumulation_steps": run.batch.accumulation, "tokens_per_optimizer_step": run.batch.tokens_per_step,
              "zero_stage": run.ds_config.get("zero_optimization", {}).get("stage", 0),
              **throughput(tokens_per_step, times, f12, f6, peak), **peak_memory(), **gpu}
    mem = torch.tensor([result.get("peak_mem_gib", 0.0), host_peak_gib()], device=dist.device)
    dist.all_reduce(mem, torch.distributed.ReduceOp.MAX)  # the busiest GPU and the largest rank process
    if "peak_mem_gib" in result:
        result["peak_mem_gib"] = float(mem[0].item())
    result["host_peak_gib"] = float(mem[1].item())
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return result if dist.is_main else None


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


def worker_env(environ, nproc: int, torch_threads: int) -> dict:
    """The environment of a measurement's processes: no rank variables of an enclosing launcher, and with several
    processes each one's share of this host's threads (`torch_threads`, torch's count here) as OMP_NUM_THREADS, by
    runtime.process.host_threads, the count the trainer takes for itself beside other ranks. Both sides get it: torchrun
    would set 1, leaving an offloaded optimizer's CPU Adam one core per rank. A count the caller set is kept."""
    from model_utils.runtime.process import host_threads

    env = dict(environ, PYTHONUNBUFFERED="1")
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    if nproc > 1:
        threads, _ = host_threads({**env, "LOCAL_WORLD_SIZE": str(nproc)}, 1, 1, torch_threads)  # no narrower mask
        if threads is not None:
            env["OMP_NUM_THREADS"] = str(threads)
    return env


def run_job(job: dict, nproc: int, timeout: int, log_dir: Path | None, script: Path | None = None) -> dict:
    """Run one measurement in fresh processes (`script --worker JOB --result FILE`, this one by default); return its
    result or {'error': ...}."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        result_path = f.name
    os.unlink(result_path)
    me = str((script or Path(__file__)).resolve())
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", me]
    else:
        cmd = [sys.executable, me]
    cmd += ["--worker", json.dumps(job), "--result", result_path]
    import torch

    env = worker_env(os.environ, nproc, torch.get_num_threads())
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


def result_reporter(json_path: str | None, vers: dict, nproc: int, command: str):
    """report(job, result) for run_jobs: a line per run (its figures rounded, the log's tail where it failed) and,
    with `json_path`, the run appended there as a JSON line with the versions and the command."""
    def report(job: dict, r: dict) -> None:
        short = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items() if k not in ("losses", "tail")}
        print(f"{job['name']}: {json.dumps(short)}", flush=True)
        if "tail" in r:
            print(r["tail"], flush=True)
        if json_path:
            with open(json_path, "a") as f:
                record = {"job": job, "result": r, "versions": vers, "nproc": nproc, "command": command}
                f.write(json.dumps(record) + "\n")

    return report


def _ds_set_suffix(items: list[str]) -> str:
    """`-overlap_comm-false` for zero_optimization.overlap_comm=false: the key's last part and the value."""
    parts = [item.partition("=") for item in items]
    return "".join(f"-{key.rsplit('.', 1)[-1]}-{value}" for key, _, value in parts)


def seq_len(a) -> int:
    from model_utils.config.presets import default_seq_len

    return a.seq_len or default_seq_len(a.model)


def global_batch_problem(a) -> str | None:
    """--global_batch_tokens that some measured micro-batch (ours or the peer's) cannot make whole steps of."""
    if not a.global_batch_tokens:
        return None
    peers = a.micro_batch_size if a.hf_micro_batch_size is None else a.hf_micro_batch_size
    for mb in sorted({m for m in (a.micro_batch_size or []) + (peers or []) if m}):
        per_micro_step = mb * a.nproc * seq_len(a)
        if a.global_batch_tokens % per_micro_step:
            return (f"--global_batch_tokens {a.global_batch_tokens}: not a multiple of micro-batch {mb} x {a.nproc} "
                    f"GPU(s) x seq_len {seq_len(a)} = {per_micro_step} tokens")
    return None


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

    def accumulation(mb) -> int:
        """Micro-batches per optimizer step for --global_batch_tokens (1 without it); checked in main()."""
        if not a.global_batch_tokens or not mb:
            return 1
        return a.global_batch_tokens // (mb * a.nproc * seq_len(a))

    def blocks(mb) -> int:
        if a.global_batch_tokens:  # whole optimizer steps of the global batch, whatever the micro-batch
            return (a.steps + a.warmup + 2) * a.global_batch_tokens // seq_len(a) + 8
        return max(64, (a.steps + a.warmup + 2) * (mb or 16) * a.nproc + 8)

    def suffix_ga(mb) -> str:
        return f"-ga{accumulation(mb)}" if accumulation(mb) > 1 else ""

    ours = a.micro_batch_size or [None]
    peers = ours if a.hf_micro_batch_size is None else a.hf_micro_batch_size
    # The peer's activation checkpointing: as ours unless --hf-gradient-checkpointing names the settings to measure.
    peer_checkpointing = ([setting == "on" for setting in a.hf_gradient_checkpointing] if a.hf_gradient_checkpointing
                          else [a.gradient_checkpointing])
    one_round = []
    suffix = (f"-z{a.zero_stage}" if a.zero_stage is not None else "") + _ds_set_suffix(a.ds_set)
    for mb in ours + [mb for mb in peers if mb not in ours]:
        if mb in ours:
            one_round += [engine(v, f"engine-{v}-mb{mb}{suffix_ga(mb)}{suffix}", micro_batch_size=mb,
                                 dummy_blocks=blocks(mb), global_batch_tokens=a.global_batch_tokens)
                          for v in a.variants]
        if a.compare_hf and mb in peers:
            for peer, spec in HF_PEERS.items():
                if peer in a.hf_skip or (peer == "liger_fa4" and not a.hf_fa4):
                    continue
                for checkpointing in peer_checkpointing:
                    one_round.append(dict(base, kind="hf", micro_batch_size=mb or 8, dummy_blocks=blocks(mb or 8),
                                          **spec, gradient_checkpointing=checkpointing,
                                          gradient_accumulation_steps=accumulation(mb or 8),
                                          name=f"hf-{peer}-mb{mb}{suffix_ga(mb or 8)}{'-gc' if checkpointing else ''}",
                                          variant="hf+" + peer.replace("_", "+")))
    jobs = one_round if a.rounds == 1 else [traced(dict(job, name=f"{job['name']}-r{k}", round=k))
                                            for k in range(1, a.rounds + 1) for job in one_round]
    if a.loss_check:
        ref = a.loss_check_reference
        for v in [ref] + [x for x in a.loss_check_variants if x != ref]:
            jobs.append(engine(v, f"losscheck-{v}-mb{a.loss_check_mb}", steps=a.loss_check, warmup=0, profile=False,
                               micro_batch_size=a.loss_check_mb,
                               dummy_blocks=(a.loss_check + 1) * a.loss_check_mb * a.nproc + 8))
    return jobs


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
    p.add_argument("--global_batch_tokens", type=int, default=None, metavar="N",
                   help="tokens per optimizer step on both sides; accumulation = N / (micro-batch x GPUs x seq_len)")
    p.add_argument("--hf-gradient-checkpointing", dest="hf_gradient_checkpointing", nargs="*", default=None,
                   choices=("off", "on"), help="the peer's activation checkpointing settings to measure "
                                               "(default: as --gradient_checkpointing)")
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
                   choices=list(VARIANTS), help="the path the losses are compared to: the unoptimised one (nofused, "
                                                "nofused_document_mask); another variant to run one path alone, its "
                                                "losses compared offline with report.loss_check (a model too large "
                                                "for both runs in one process)")
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
    problem = global_batch_problem(a)
    if problem:
        p.error(problem)
    log_dir = Path(a.log_dir) if a.log_dir else None
    if log_dir:
        log_dir.mkdir(parents=True, exist_ok=True)
    jobs = make_jobs(a)
    vers = versions()
    command = "python benchmarks/bench.py " + " ".join(shlex.quote(x) for x in (argv if argv is not None else sys.argv[1:]))
    print(f"# {command}\n# {json.dumps(vers)}", flush=True)

    report = result_reporter(a.json, vers, a.nproc, command)
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
