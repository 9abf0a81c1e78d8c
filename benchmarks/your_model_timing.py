#!/usr/bin/env python3
"""A model of your own against the same architecture built in: is the extension point free?

    python benchmarks/your_model_timing.py --model qwen3-0.6b --seq_len 2048 --micro_batch_size 8 --steps 25
    python benchmarks/your_model_timing.py --model tiny --seq_len 64 --micro_batch_size 2 --steps 4 --warmup 1  # CPU

Two trainer runs on this machine, one after the other, with the same DeepSpeed config, batch, precision and length:
`--model PRESET --dummy_data N` (the built-in path) and `--model benchmarks/your_model/preset_model.py:build
--dataset benchmarks/your_model/random_blocks.py:build` (the preset's architecture through the extension point).
The built-in path runs with its speed options off (--fused_kernels off --compile off --attention_kernel sdpa), the
kernels a model of your own gets; both compute the loss over materialised logits. Reported: each side's mean and
median step time and tokens/s over the steps after --warmup, read from the run's metrics.jsonl, and their ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TRAINER = REPO / "src" / "train_deepspeed.py"
OFF = ["--fused_kernels", "off", "--compile", "off", "--attention_kernel", "sdpa"]


def side_argv(side: str, a) -> list[str]:
    common = ["--seq_len", str(a.seq_len), "--micro_batch_size", str(a.micro_batch_size), "--max_steps", str(a.steps),
              "--log_interval", "1", "--eval_interval", "0", "--checkpoint_freq", "0", "--no-export",
              "--validation_fraction", "0", "--ds_config", a.ds_config, "--gradient_accumulation_steps", "1"]
    if side == "preset":
        return ["--model", a.model, "--dummy_data", str(a.blocks), *OFF, *common]
    return ["--model", f"{REPO / 'benchmarks/your_model/preset_model.py'}:build", "--model_args",
            json.dumps({"preset": a.model}), "--dataset", f"{REPO / 'benchmarks/your_model/random_blocks.py'}:build",
            "--data_args", json.dumps({"blocks": a.blocks}), *common]


def run_side(side: str, a, workdir: Path) -> dict:
    run_dir = workdir / side
    argv = [sys.executable, str(TRAINER), "--checkpoint_dir", str(run_dir), *side_argv(side, a)]
    print("# " + " ".join(argv), flush=True)
    env = dict(os.environ, WORLD_SIZE="1", RANK="0", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(a.port + (side == "yours")))
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=a.timeout)
    (workdir / f"{side}.log").write_text(done.stdout + done.stderr)
    if done.returncode:
        return {"side": side, "error": f"exit {done.returncode} (log: {workdir / f'{side}.log'})"}
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in steps if "step_time_s" in r and r["step"] > a.warmup]
    times = [r["step_time_s"] for r in steps]
    tokens = a.micro_batch_size * a.seq_len
    return {"side": side, "steps": len(times), "step_s_mean": statistics.fmean(times),
            "step_s_median": statistics.median(times), "tokens_per_s_mean": tokens / statistics.fmean(times),
            "peak_mem_gib": max((r.get("peak_mem_gib") or 0) for r in steps)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen3-0.6b", help="a text preset")
    p.add_argument("--seq_len", type=int, default=2048)
    p.add_argument("--micro_batch_size", type=int, default=8)
    p.add_argument("--steps", type=int, default=25)
    p.add_argument("--warmup", type=int, default=5, help="first steps left out of the means")
    p.add_argument("--blocks", type=int, default=512)
    p.add_argument("--ds_config", default="ds_config.json")
    p.add_argument("--timeout", type=int, default=600)
    p.add_argument("--port", type=int, default=29611)
    p.add_argument("--json", help="append the result here (JSON lines)")
    p.add_argument("--workdir")
    a = p.parse_args(argv)
    workdir = Path(a.workdir or tempfile.mkdtemp(prefix="your-model-timing-"))
    workdir.mkdir(parents=True, exist_ok=True)
    sides = [run_side(side, a, workdir) for side in ("preset", "yours")]
    print("| side | steps | step s mean / median | tokens/s (mean) | peak GiB |\n|---|---|---|---|---|")
    for s in sides:
        print(f"| {s['side']} | {s['error']} | | | |" if "error" in s else
              f"| {s['side']} | {s['steps']} | {s['step_s_mean']:.4f} / {s['step_s_median']:.4f} | "
              f"{s['tokens_per_s_mean']:,.0f} | {s['peak_mem_gib']:.1f} |")
    ok = all("error" not in s for s in sides)
    if ok:
        ratio = sides[0]["step_s_mean"] / sides[1]["step_s_mean"]
        print(f"yours / preset speed: {ratio:.3f}x mean, "
              f"{sides[0]['step_s_median'] / sides[1]['step_s_median']:.3f}x median")
    if a.json:
        with open(a.json, "a") as f:
            f.write(json.dumps({"args": vars(a), "sides": sides}) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
