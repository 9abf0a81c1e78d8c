"""Long sequences on the GPU: the trainer at given lengths and --sequence_parallel sizes, one torchrun per case, each
case's steps read back from its metrics.jsonl (loss, tokens/s per GPU, MFU, peak GPU memory) and its exit (done, out of
memory, failed). Random-token blocks (--dummy_data): what one optimizer step costs does not depend on the tokens.

    python3 benchmarks/long_context.py --json results.jsonl --log-dir logs --nproc 2 --model llama-1b \\
        --seq_len 65536 131072 --sequence_parallel 2 --steps 3 -- --gradient_checkpointing

Arguments after `--` go to every trainer run. A case's record has `status` "ok", "oom" or "failed" and, when it
trained, its per-step records; `--stop-at-oom` skips the longer lengths of a size once one runs out of memory;
`--stop-after-steps` ends a run once its steps are logged, before its final checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def step_records(metrics: Path) -> list[dict]:
    """The trained steps' records of a run's metrics.jsonl (a line being written is left for the next read)."""
    records = []
    if metrics.exists():
        for line in metrics.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if "loss" in record and "lr" in record:
                records.append(record)
    return records


def kill_with_descendants(pid: int) -> None:
    """SIGKILL a process and every process below it: torchrun starts its ranks in sessions of their own, and a
    SIGTERM would have them save a checkpoint (the trainer's preemption path)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, queue = [], [pid]
    while queue:
        found.append(queue.pop())
        queue += children.get(found[-1], [])
    for each in found:
        try:
            os.kill(each, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run_case(args, extra, seq_len: int, split: int, nproc: int) -> dict:
    name = f"{args.model}-T{seq_len}-sp{split}-gpus{nproc}" + ("-peer" if args.peer else "")
    work = Path(args.workdir) / name
    shutil.rmtree(work, ignore_errors=True)
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    blocks = max(args.steps * nproc // split * 2, 8)
    launch = ["torchrun", "--standalone", f"--nproc_per_node={nproc}"]
    if args.peer:  # Hugging Face Trainer's Ulysses path on the same model, lengths and config (long_context_peer.py)
        command = [*launch, str(REPO / "benchmarks" / "long_context_peer.py"), "--model", args.model, "--seq_len",
                   str(seq_len), "--sequence_parallel", str(split), "--steps", str(args.steps), "--ds_config",
                   args.ds_config, "--checkpoint_dir", str(work), "--attn", args.peer_attn, *extra]
    else:
        command = [*launch, str(REPO / "src" / "train_deepspeed.py"),
                   "--model", args.model, "--seq_len", str(seq_len), "--sequence_parallel", str(split),
                   "--dummy_data", str(blocks), "--max_steps", str(args.steps), "--micro_batch_size", "1",
                   "--log_interval", "1", "--eval_interval", "0", "--checkpoint_freq", "0", "--no-export",
                   "--checkpoint_dir", str(work), "--ds_config", args.ds_config, *extra]
    t0 = time.monotonic()
    metrics = work / "metrics.jsonl"
    stopped = False
    with open(log_dir / f"{name}.log", "w") as log:
        proc = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        while True:
            try:
                code = proc.wait(timeout=2)
                break
            except subprocess.TimeoutExpired:
                pass
            stopped = bool(args.stop_after_steps) and len(step_records(metrics)) >= args.stop_after_steps
            if stopped or time.monotonic() - t0 > args.timeout:
                kill_with_descendants(proc.pid)
                proc.wait()
                code = 0 if stopped else "timeout"
                break
    text = (log_dir / f"{name}.log").read_text(errors="replace")
    records = step_records(metrics)
    status = "ok" if code == 0 else ("oom" if "OutOfMemoryError" in text or "out of memory" in text else "failed")
    summary = {"case": name, "model": args.model, "seq_len": seq_len, "sequence_parallel": split, "gpus": nproc,
               "status": status, "exit": code, "stopped_before_final_save": stopped,
               "wall_s": round(time.monotonic() - t0, 1), "steps": records, "extra_args": extra,
               "side": ("hf-trainer-ulysses" if split > 1 else "hf-trainer") if args.peer else "ours",
               "ds_config": args.ds_config, "log_tail": "" if status == "ok" else text[-3000:]}
    timed = records[args.skip:] or records
    if timed:
        mean = lambda key: sum(r[key] for r in timed if r.get(key) is not None) / len(timed)  # noqa: E731
        summary.update(mean_step_time_s=mean("step_time_s"), tokens_per_s_per_device=mean("tokens_per_s_per_device"),
                       mfu=mean("mfu") if timed[0].get("mfu") is not None else None,
                       peak_gib=max(r.get("peak_mem_gib", 0) or 0 for r in records))
    for line in text.splitlines():
        if line.startswith(("memory:", "tiled MLP", "sequence parallelism", "attention:", "activation checkpointing",
                            "long sequences:", "peer:", "host memory:", "offloaded activations:",
                            "kernels: the fused loss's chunk budget")):
            summary.setdefault("header", []).append(line[:300])
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", required=True)
    parser.add_argument("--log-dir", required=True)
    parser.add_argument("--write-doc", default=None, help="accepted for run_device.sh; not written")
    parser.add_argument("--model", default="llama-1b")
    parser.add_argument("--ds_config", default="ds_config.json")
    parser.add_argument("--seq_len", type=int, nargs="+", required=True)
    parser.add_argument("--sequence_parallel", type=int, nargs="+", default=[1])
    parser.add_argument("--nproc", type=int, nargs="+", default=None, help="GPUs per case (default: the split size)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--skip", type=int, default=1, help="first steps left out of the means (compile, warm-up)")
    parser.add_argument("--timeout", type=int, default=300)
    parser.add_argument("--workdir", default="/tmp/long-context")
    parser.add_argument("--stop-at-oom", action="store_true")
    parser.add_argument("--stop-after-steps", type=int, nargs="?", const=-1, default=0, metavar="N",
                        help="end each run once N steps (alone: all its steps) are logged, before its final checkpoint "
                             "(a large model's save is not what is measured, and can outlast the call)")
    parser.add_argument("--title", default="")
    parser.add_argument("--peer", action="store_true", help="run Hugging Face Trainer's Ulysses path instead "
                        "(long_context_peer.py; of the trainer flags after `--` it takes --gradient_checkpointing, "
                        "--lora_rank and --rope_scaling)")
    parser.add_argument("--peer-attn", dest="peer_attn", default="sdpa",
                        choices=("sdpa", "flash_attention_2", "flash_attention_3"))
    args, extra = parser.parse_known_args()
    if args.stop_after_steps == -1:
        args.stop_after_steps = args.steps
    extra = [a for a in extra if a != "--"]
    for split in args.sequence_parallel:
        for nproc in args.nproc or [split]:
            for seq_len in args.seq_len:
                result = run_case(args, extra, seq_len, split, nproc)
                result["title"] = args.title
                with open(args.json, "a") as f:
                    f.write(json.dumps(result) + "\n")
                shown = {k: result.get(k) for k in ("case", "status", "mean_step_time_s", "tokens_per_s_per_device",
                                                    "mfu", "peak_gib")}
                losses = [round(r["loss"], 4) for r in result["steps"]]
                print(f"{result['side']} {json.dumps(shown)} losses {losses[:3]}...{losses[-3:]}", flush=True)
                if result["status"] != "ok":
                    print("# " + result["log_tail"][-1500:].replace("\n", "\n# "), flush=True)
                    if args.stop_at_oom and result["status"] == "oom":
                        break
    return 0


if __name__ == "__main__":
    sys.exit(main())
