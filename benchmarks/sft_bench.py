#!/usr/bin/env python3
"""Supervised fine-tuning throughput on chat data: the trainer's own path against TRL's SFTTrainer + DeepSpeed + Liger.

    python benchmarks/sft_bench.py --model qwen3-1.7b --seq_len 2048 --global_batch_tokens 65536 \\
        --micro_batch_size 8 16 --peer-micro-batch-size 1 2 --modes full lora
    python benchmarks/sft_bench.py --model tiny --seq_len 128 --micro_batch_size 1 --global_batch_tokens 256 \\
        --steps 2 --warmup 1 --max_examples 64                                      # CPU smoke run
    python benchmarks/sft_bench.py --peer unsloth --peer-env DIR --modes lora qlora --model llama-8b ...  # the peers
        # of sft_peers.py (trl, unsloth, axolotl); --modes qlora: ours with --load_in_4bit; --print-config: no GPU

Both sides train the same model on the same chat rows, at the same global batch (blocks of --seq_len per optimizer
step), with the same DeepSpeed config and the same optimizer and schedule:

- Model: a preset name is written once as a random-init Hugging Face model (bf16 safetensors and the run's tokenizer,
  its chat template attached) under --workdir, and both sides load that directory; a model directory is used as it is.
- Rows: --dataset embedded-chat (the project's chats about the standard library, data.chat_corpus.build_sft_corpus: its
  train split) or a chat JSONL file (`messages` per row); the first --max_examples rows of it are written to
  --workdir/rows.jsonl, which both sides read.
- Ours: `parse_args` (--dataset ROWS --data_format chat --validation_fraction 0, --lora_rank for the LoRA row) ->
  `make_plan` -> `check_plan(check_disk=False)` -> `build_run` -> `train_step` + `agree_after_step`, timed per step
  after --warmup steps as bench.py times it. Examples are packed whole into blocks (best fit, positions restarting at
  every example, the rest of a block padding); the loss is on the assistant tokens.
- Peer: TRL `SFTTrainer` with `SFTConfig(packing=True, packing_strategy="bfd", padding_free=True,
  assistant_only_loss=True, max_length=--seq_len, use_liger_kernel=True on CUDA, bf16 on CUDA, gradient
  checkpointing as ours, deepspeed=the same config with HF's "auto" values)`, the tokenizer with the chat template
  ours renders with (its `{% generation %}` marks give both sides the same assistant mask), the learning rate,
  betas, epsilon, weight decay, clipping and warm-up of our plan, and for the LoRA row
  `peft_config=models.lora.lora_config(...)`: the LoraConfig our run builds (rank, alpha, dropout, targets). Timed by a
  TrainerCallback over whole optimizer steps with CUDA synchronised, as hf_peer.py does.
  TRL documents padding-free rows as supported with FlashAttention only; `--peer-packing none` runs TRL's path for the
  other attention kernels instead: no packing, each micro-batch of --peer-micro-batch-size examples padded to its
  longest (`grouped`: the same with `train_sampling_strategy="group_by_length"`, Trainer's sampler of examples of
  like length, which pads less), as many examples per optimizer step as ours packs into its blocks (the block tokens
  per step over the examples' mean length).

What differs by design, each side as its library does it: TRL packs the tokenized conversations (n tokens each) into
bins of --seq_len by its own best-fit decreasing and flattens a micro-batch's bins into one row without padding
(padding-free, positions restarting per example); ours packs the shifted examples (n - 1 positions each) into blocks
of --seq_len with padding at each block's end. Trainer shuffles the bins by its seed, ours its blocks by the run's seed.
So the steps see different examples: the report compares the mean loss over the same steps, beside each side's
first losses. Trainer's loss is the token mean over the optimizer step, ours the mean of the micro-batches' means.

Tokens counted, both sides alike: the positions of the timed steps that hold example tokens (non-padding), per GPU.
TFLOP/s and MFU by the project's convention (report.flops_per_token: 6N over those tokens, N the base model's
matrix parameters, the adapters left out, plus attention within each example: 12·L·H·Q per query-key pair, and
torchtitan's 6·L·H·Q). Also reported: the loss-carrying tokens per step, peak GPU memory, and per mode each side at
its fastest micro-batch with the ratio.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import cuda_sync, ds_config_for, host_peak_gib, normalize_env, peak_memory  # noqa: E402
from fine_tuning_cli import add_run_arguments, report, reporter, results_table  # noqa: E402
from report import base_parameters, flops_per_token, throughput, versions  # noqa: E402
from telemetry import GpuTelemetry  # noqa: E402

SIDES = {"ours": "ours", "trl": "TRL SFTTrainer"}  # "trl": the peer's slot, whichever --peer fills it
MODES = ("full", "lora", "qlora")
IGNORE_INDEX = -100
LOSSES_SHOWN = 5  # first losses printed per side


# ----------------------------------------------------------------------------------------------------------------------
# What both workers count
# ----------------------------------------------------------------------------------------------------------------------
def segment_lengths(positions) -> list[int]:
    """The lengths of the runs in one row of position ids: a run starts wherever the position is 0."""
    import numpy as np

    positions = np.asarray(positions).reshape(-1)
    starts = np.flatnonzero(positions == 0)
    if len(starts) == 0 or starts[0] != 0:
        starts = np.concatenate([[0], starts])
    return np.diff(np.append(starts, len(positions))).tolist()


def block_example_lengths(positions, targets) -> list[int]:
    """The examples' lengths in one packed block of ours: its runs of positions, less a last run whose targets carry
    no loss (the padding; every example placed carries loss, data.sft.packing.pack_examples)."""
    import numpy as np

    lengths = segment_lengths(positions)
    targets = np.asarray(targets).reshape(-1)
    if lengths and not (targets[len(targets) - lengths[-1]:] != IGNORE_INDEX).any():
        lengths = lengths[:-1]
    return lengths


def peer_example_lengths(packing: str, numel: int, positions, rows_lengths) -> list[int]:
    """The examples' lengths in one of TRL's micro-batches: with packing (bfd), the runs of its flattened row's position
    ids; without, each padded row's attention-mask count (its example, not the padding); a row of neither, whole."""
    if packing != "bfd" and rows_lengths is not None:
        return [int(n) for n in rows_lengths.cpu().tolist()]
    return segment_lengths(positions.cpu().numpy()) if positions is not None else [numel]


def work_of(lengths: list[int]) -> tuple[int, int]:
    """(tokens, attention query-key pairs) of examples of these lengths, each attending within itself."""
    return sum(lengths), sum(n * n for n in lengths)


def figures(config, num_params: int, seq_len: int, tokens: int, area: int, loss_tokens: int, times: list[float],
            world_size: int) -> dict:
    """Per-GPU throughput of the timed steps from the tokens and attention pairs all ranks processed in them."""
    import torch

    from model_utils.models.build import gpu_peak_tflops

    steps = max(len(times), 1)
    per_gpu_step = tokens / world_size / steps
    f12, f6 = flops_per_token(config, num_params, seq_len, area / tokens if tokens else None)
    peak = gpu_peak_tflops(torch.cuda.get_device_name()) if torch.cuda.is_available() else None
    return {"tokens_per_step_per_gpu": per_gpu_step, "loss_tokens_per_step_per_gpu": loss_tokens / world_size / steps,
            **throughput(per_gpu_step, times, f12, f6, peak)}


def liger_applied(model) -> bool:
    """Whether Liger's kernels are in `model`: Trainer's use_liger_kernel swaps modules for Liger's classes or their
    forward for Liger's functions, and leaves the model as it was where Liger does not know its family."""
    for module in model.modules():
        forward = getattr(type(module), "forward", None)
        bound = getattr(module, "forward", None)
        if any(getattr(x, "__module__", "").startswith("liger_kernel") for x in (type(module), forward, bound)):
            return True
    return False


def all_ranks_sum(values: list[float], device) -> list[float]:
    """`values` summed over the ranks (as they are without a process group)."""
    import torch

    if not torch.distributed.is_initialized():
        return values
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    torch.distributed.all_reduce(tensor)
    return tensor.tolist()


def all_ranks_max(value: float, device) -> float:
    import torch

    if not torch.distributed.is_initialized():
        return value
    tensor = torch.tensor([value], dtype=torch.float64, device=device)
    torch.distributed.all_reduce(tensor, torch.distributed.ReduceOp.MAX)
    return float(tensor.item())


# ----------------------------------------------------------------------------------------------------------------------
# Workers (one process per GPU; rank 0 writes the result)
# ----------------------------------------------------------------------------------------------------------------------
def trainer_argv(job: dict, workdir: Path) -> list[str]:
    """The trainer's flags for a job: its rows as chat data, the global batch, the DeepSpeed config, LoRA."""
    return ["--model", job["model"], "--dataset", job["rows"], "--data_format", "chat", *run_flags(job, workdir)]


def run_flags(job: dict, workdir: Path) -> list[str]:
    """The trainer's flags every benchmark job of ours takes beside its data: no held-out blocks, the packed data's
    cache, the block length, the batch, the steps, the DeepSpeed config, no saves or logs, LoRA."""
    argv = ["--validation_fraction", "0", "--data_cache_dir", job["data_cache"], "--seq_len", str(job["seq_len"]),
            "--micro_batch_size", str(job["micro_batch_size"]),
            "--global_batch_tokens", str(job["global_batch_tokens"]),
            "--max_steps", str(job["steps"] + job["warmup"]),
            "--ds_config", str(ds_config_for(job, workdir / "ds_config.json")),
            "--checkpoint_dir", str(workdir / "ckpt"), "--resume", "never", "--eval_interval", "0",
            "--checkpoint_freq", "0", "--no-export", "--log_interval", str(10**6), "--seed", str(job["seed"]),
            "--attention_kernel", job.get("attention_kernel", "auto")]
    if job.get("gradient_checkpointing"):
        argv.append("--gradient_checkpointing")
    if job["mode"] in ("lora", "qlora"):
        argv += ["--lora_rank", str(job["lora_rank"]), "--lora_alpha", str(job["lora_alpha"]),
                 "--lora_dropout", str(job.get("lora_dropout", 0.05))]
        if job.get("lora_target_modules"):
            argv += ["--lora_target_modules", job["lora_target_modules"]]
    if job["mode"] == "qlora":
        argv.append("--load_in_4bit")
    return argv


def worker_ours(job: dict, workdir: Path) -> dict | None:
    normalize_env()
    import numpy as np

    from model_utils.train.step import train_step

    steps, warmup = job["steps"], job["warmup"]
    cfg, dist, run, setup_s = built_run(trainer_argv(job, workdir))
    # this rank's mean over its micro-batches (fine-tuning data: its share of the step's per-token mean, x ranks)
    times, losses, timed_blocks, gpu = timed_steps(run, train_step, steps, warmup,
                                                   lambda result: result.loss_sum.item() / run.batch.accumulation)
    tokens = area = loss_tokens = 0
    for index in timed_blocks:  # counted after the timed steps, from the host's copy of the blocks
        block = run.data.train.batch([index])
        t, a = work_of(block_example_lengths(block.position_ids[0], block.targets[0]))
        tokens, area, loss_tokens = tokens + t, area + a, loss_tokens + block.loss_tokens
    tokens, area, loss_tokens = all_ranks_sum([tokens, area, loss_tokens], dist.device)
    data_loss_tokens = int((np.asarray(run.data.train.targets) != IGNORE_INDEX).sum())  # every block trains
    out = {"side": "ours", "data_loss_tokens": data_loss_tokens, "mode": job["mode"], "world_size": dist.world_size,
           "setup_s": setup_s, "losses": losses,
           "micro_batch_size": run.batch.micro, "gradient_accumulation_steps": run.batch.accumulation,
           "seq_len": run.batch.seq_len, "blocks_per_step": run.batch.micro * run.batch.accumulation * dist.world_size,
           "num_params": base_parameters(run.engine.module), "timed_steps": len(times),
           # the kernels that ran: the attention over the examples and Liger's, as the run resolved them
           "attention": run.speed_in_force.get("attention_kernel", cfg.model.attn_implementation),
           "liger": run.speed_in_force.get("fused_kernels", "off"),
           **figures(run.engine.module.config, base_parameters(run.engine.module), run.batch.seq_len, int(tokens),
                     int(area), int(loss_tokens), times, dist.world_size), **gpu}
    return worker_result(out, dist)


def built_run(argv: list[str]):
    """(cfg, dist, run, setup seconds): the trainer's run of `argv` as its main() builds it, on this process's rank
    (parse_args -> make_plan -> check_plan -> build_run), without the disk checks: a benchmark never saves."""
    from model_utils.config.flags import parse_args
    from model_utils.planning.plan import make_plan
    from model_utils.planning.preflight import check_plan, raise_on_problems
    from model_utils.runtime.distributed import distributed_env_problems, setup_distributed
    from model_utils.train.build import build_run, start_log

    cfg = parse_args(argv)
    assert not distributed_env_problems()
    dist = setup_distributed()
    t0 = time.perf_counter()
    log = start_log(cfg, dist)
    plan = make_plan(cfg, dist.world_size, on_training_hardware=True)
    raise_on_problems(check_plan(plan, check_disk=False))
    run = build_run(plan, dist, log)
    return cfg, dist, run, time.perf_counter() - t0


def worker_result(out: dict, dist) -> dict | None:
    """A worker's result with every rank's peak memory (GPU and host, the largest) on rank 0, the process group
    ended; None on the other ranks."""
    import torch

    out.update(peak_memory())
    if "peak_mem_gib" in out:
        out["peak_mem_gib"] = all_ranks_max(out["peak_mem_gib"], dist.device)
    out["host_peak_gib"] = all_ranks_max(host_peak_gib(), dist.device)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return out if dist.is_main else None


def timed_steps(run, step, steps: int, warmup: int, loss_of) -> tuple[list, list, list, dict]:
    """(each timed step's seconds, every step's `loss_of(result)`, the blocks the timed steps read, GPU telemetry):
    `step(run)` and the collective after it, --warmup steps untimed first, CUDA synchronised at both ends, as the
    trainer's loop runs them."""
    from model_utils.train.step import agree_after_step

    run.engine.train()
    times, losses, timed_blocks = [], [], []
    telemetry = GpuTelemetry()
    for i in range(steps + warmup):
        if i == warmup and run.dist.is_main:
            telemetry.start()
        cuda_sync()
        t = time.perf_counter()
        result = step(run)
        agree_after_step(run, result)
        cuda_sync()
        dt = time.perf_counter() - t
        losses.append(loss_of(result))
        if i >= warmup:
            times.append(dt)
            timed_blocks += result.blocks
    return times, losses, timed_blocks, telemetry.stop()


def read_rows(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def median_tokens_per_s(result: dict) -> float:
    """A run's tokens per second at its median step: its mean example tokens per step over its median step time."""
    return result["tokens_per_step_per_gpu"] / result["step_s_median"]


def worker_main(job_json: str, result_path: str) -> int:
    job = json.loads(job_json)
    with tempfile.TemporaryDirectory(prefix="sft-bench-") as tmp:
        if job["side"] == "ours":
            result = worker_ours(job, Path(tmp))
        else:  # the peer (sft_peers.py), in its own environment where --peer-env gives one
            from sft_peers import WORKERS

            result = WORKERS[job.get("peer", "trl")](job, Path(tmp))
    if result is not None:
        Path(result_path).write_text(json.dumps(result))
    return 0


# ----------------------------------------------------------------------------------------------------------------------
# Driver: the rows and the model both sides read, the runs, the report
# ----------------------------------------------------------------------------------------------------------------------
class BenchProblem(Exception):
    """Input the benchmark cannot run with; the message names it and says what to do."""


def write_rows(dataset: str, max_examples: int, out: Path) -> tuple[Path, int]:
    """The first `max_examples` chat rows (0: all) of --dataset as JSONL at `out`, each checked as a chat
    (data.sft.formats.check_row); returns the file and its row count."""
    from model_utils.data.chat_corpus import build_sft_corpus, split_files
    from model_utils.data.errors import DataError
    from model_utils.data.sft.formats import check_row

    if dataset == "embedded-chat":
        source = split_files(build_sft_corpus())["train"]
    else:
        source = dataset
        if not Path(source).is_file():
            raise BenchProblem(f"--dataset {dataset}: no such file; give a chat JSONL file (one "
                               '{"messages": [{"role": ..., "content": ...}, ...]} per line) or embedded-chat')
    rows = []
    with open(source, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise BenchProblem(f"--dataset {dataset}: line {number} is not JSON ({e.msg}); write one JSON "
                                   "object per line") from e
            if not isinstance(row, dict) or "messages" not in row:
                raise BenchProblem(f"--dataset {dataset}: line {number} has no `messages` (the benchmark measures "
                                   "chat data); give each row a list of {role, content} messages")
            try:
                check_row(row, "chat", number, dataset)
            except DataError as e:
                raise BenchProblem(str(e)) from e
            rows.append({"messages": row["messages"]})
            if max_examples and len(rows) == max_examples:
                break
    if not rows:
        raise BenchProblem(f"--dataset {dataset}: holds no rows; give a chat JSONL file with conversations")
    out.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
    return out, len(rows)


def model_directory(model: str, seed: int, workdir: Path) -> Path:
    """The model both sides load: a preset written once under `workdir` as a random-init Hugging Face model (bf16,
    the run's tokenizer with the chat template ours renders with), or the directory given."""
    from model_utils.config.presets import is_preset, preset_names

    if not is_preset(model):
        path = Path(model)
        if not (path / "config.json").is_file():
            raise BenchProblem(f"--model {model}: neither a preset ({preset_names()}) nor a model directory with "
                               "config.json; give a preset or a Hugging Face model directory (the trainer's --export "
                               "writes one)")
        return path.resolve()
    out = workdir / f"model-{model.lower()}-seed{seed}"
    if (out / "config.json").is_file():
        return out
    import torch

    from model_utils.data.sft.formats import attach_chat_template
    from model_utils.data.tokenizer import load_tokenizer
    from model_utils.models.build import build_model, model_config
    from model_utils.runtime.process import seed_everything

    tokenizer = load_tokenizer(None)
    attach_chat_template(tokenizer)
    seed_everything(seed)
    # initialised on the GPU where there is one: a 7B model's random init takes minutes on a host's CPU
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        built = build_model(model, model_config(model, tokenizer), torch.bfloat16, "sdpa", False)
    tmp = out.with_name(out.name + ".tmp")
    built.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    os.replace(tmp, out)
    return out


def global_batch(a) -> int:
    """--global_batch_tokens, checked against every micro-batch measured; default: the least that each makes whole
    optimizer steps of."""
    # the peer's micro-batches hold bins of seq_len when it packs, padded examples otherwise (no multiple to meet)
    packed = a.micro_batch_size + (a.peer_micro_batch_size if a.peer_packing == "bfd" else [])
    per_micro = {mb: mb * a.nproc * a.seq_len for mb in sorted(set(packed))}
    if not a.global_batch_tokens:
        return math.lcm(*per_micro.values())
    for mb, tokens in per_micro.items():
        if a.global_batch_tokens % tokens:
            raise BenchProblem(f"--global_batch_tokens {a.global_batch_tokens}: not a multiple of micro-batch {mb} x "
                               f"{a.nproc} GPU(s) x seq_len {a.seq_len} = {tokens} tokens; give a multiple of each")
    return a.global_batch_tokens


def make_jobs(a, model: Path, rows: Path, data_cache: Path, global_tokens: int) -> list[dict]:
    """Per mode: ours at each --micro_batch_size, then the peer at each --peer-micro-batch-size."""
    base = {"model": str(model), "rows": str(rows), "data_cache": str(data_cache), "seq_len": a.seq_len,
            "global_batch_tokens": global_tokens, "steps": a.steps, "warmup": a.warmup, "seed": a.seed,
            "ds_config": a.ds_config, "zero_stage": a.zero_stage, "ds_set": a.ds_set,
            "gradient_checkpointing": a.gradient_checkpointing, "lora_rank": a.lora_rank, "lora_alpha": a.lora_alpha,
            "lora_target_modules": a.lora_target_modules, "peer_liger": a.peer_liger == "on",
            "peer_attn": a.peer_attn, "attention_kernel": a.attention_kernel, "peer_packing": a.peer_packing,
            "lora_dropout": a.lora_dropout, "peer": a.peer}
    jobs = []
    for mode in a.modes:
        for side, micro_batches in (("ours", a.micro_batch_size), ("trl", a.peer_micro_batch_size)):
            if side in a.skip:
                continue
            for mb in micro_batches:
                accumulation = global_tokens // (mb * a.nproc * a.seq_len)
                steps_of = f"ga{accumulation}" if side == "ours" or a.peer_packing == "bfd" else a.peer_packing
                label = a.peer if side == "trl" else side
                jobs.append(dict(base, side=side, mode=mode, micro_batch_size=mb,
                                 variant=f"{label}-{mode}", name=f"{label}-{mode}-mb{mb}-{steps_of}"))
    return jobs


def side_label(job: dict) -> str:
    """ours, or the peer that filled the peer's slot (sft_peers.PEERS)."""
    from sft_peers import PEERS

    return SIDES["ours"] if job["side"] == "ours" else PEERS[job.get("peer", "trl")]


def table(jobs: list[dict], results: list[dict]) -> str:
    return results_table(jobs, results, side_label, [
        ("tokens/s/GPU", lambda r: f"{r['tokens_per_s_per_gpu']:,.0f}"),
        ("TFLOP/s/GPU", lambda r: f"{r['tflops_per_gpu']:.0f}")],
        [("tokens/step/GPU", lambda r: f"{r['tokens_per_step_per_gpu']:,.0f}"),
        ("loss tokens/step/GPU", lambda r: f"{r['loss_tokens_per_step_per_gpu']:,.0f}")])


def best_of(jobs: list[dict], results: list[dict], side: str, mode: str) -> tuple[dict, dict] | None:
    ran = [(j, r) for j, r in zip(jobs, results) if j["side"] == side and j["mode"] == mode and "error" not in r]
    return max(ran, key=lambda jr: jr[1]["tokens_per_s_per_gpu"], default=None)


def compare_losses(ours: list[float], peer: list[float]) -> dict:
    """The same steps of both sides: their first losses, each side's mean over them and the difference of the means
    (the steps see different examples: see the module docstring)."""
    n = min(len(ours), len(peer))
    if not n:
        return {}
    mean_ours, mean_peer = statistics.fmean(ours[:n]), statistics.fmean(peer[:n])
    return {"steps": n, "ours_first": [round(x, 4) for x in ours[:min(n, LOSSES_SHOWN)]],
            "peer_first": [round(x, 4) for x in peer[:min(n, LOSSES_SHOWN)]], "ours_mean": mean_ours,
            "peer_mean": mean_peer, "mean_diff": mean_ours - mean_peer}


def summary(jobs: list[dict], results: list[dict], modes: list[str]) -> tuple[str, dict]:
    """Per mode: each side at its fastest micro-batch, the ratio, and the losses of those two runs."""
    lines, record = [], {}
    for mode in modes:
        ours, peer = best_of(jobs, results, "ours", mode), best_of(jobs, results, "trl", mode)
        if not ours or not peer:
            lines.append(f"{mode}: no pair ran")
            continue
        ratio = ours[1]["tokens_per_s_per_gpu"] / peer[1]["tokens_per_s_per_gpu"]  # by mean step time
        # tokens/s at each side's median step, which a stall does not move: each side's mean tokens per step (the
        # sides pack the same block tokens into different example tokens) over its median step time
        median_ratio = median_tokens_per_s(ours[1]) / median_tokens_per_s(peer[1]) if (
            ours[1].get("step_s_median") and peer[1].get("step_s_median")) else None
        losses = compare_losses(ours[1].get("losses", []), peer[1].get("losses", []))
        record[mode] = {"ours": ours[0]["name"], "peer": peer[0]["name"], "ratio": ratio,
                        "ratio_by_median_step": median_ratio, "losses": losses,
                        "kernels": {side: {"attention": r.get("attention"), "liger": r.get("liger")}
                                    for side, r in (("ours", ours[1]), ("peer", peer[1]))},
                        "data_loss_tokens": {"ours": ours[1]["data_loss_tokens"], "peer": peer[1]["data_loss_tokens"]}}
        name = side_label(peer[0]).split()[0]  # TRL, Unsloth, axolotl
        record[mode]["peer_side"] = peer[0].get("peer", "trl")
        lines.append(f"{mode}, best micro-batch each: ours {ours[1]['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU at "
                     f"{ours[0]['micro_batch_size']}, {name} {peer[1]['tokens_per_s_per_gpu']:,.0f} at "
                     f"{peer[0]['micro_batch_size']}: {ratio:.2f}x by mean step time"
                     + (f", {median_ratio:.2f}x by median" if median_ratio else "")
                     + f" (attention: ours {ours[1].get('attention')}, {name} {peer[1].get('attention')}; Liger: "
                       f"ours {ours[1].get('liger')}, {name} {peer[1].get('liger')})")
        lines.append(f"{mode}, tokens carrying loss in the whole data: ours {ours[1]['data_loss_tokens']:,}, {name} "
                     f"{peer[1]['data_loss_tokens'] or 0:,} (equal where both mask the same tokens and truncate "
                     "nothing)")
        if losses:
            lines.append(f"{mode}, losses over the same {losses['steps']} steps: ours first {losses['ours_first']}, "
                         f"{name} first {losses['peer_first']}; mean ours {losses['ours_mean']:.4f}, {name} "
                         f"{losses['peer_mean']:.4f} (ours - {name} {losses['mean_diff']:+.4f})")
    return "\n".join(lines), record


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-1.7b", help="a preset (written once as a random-init model under "
                                                          "--workdir) or a Hugging Face model directory")
    p.add_argument("--dataset", default="embedded-chat", help="embedded-chat, or a chat JSONL file (`messages`)")
    p.add_argument("--max_examples", type=int, default=0, help="the first N rows (0: all)")
    p.add_argument("--seq_len", type=int, default=2048, help="block (ours) and bin (TRL's max_length) length")
    p.add_argument("--micro_batch_size", type=int, nargs="+", default=[8], help="ours: one or more")
    p.add_argument("--peer-micro-batch-size", dest="peer_micro_batch_size", type=int, nargs="+", default=None,
                   help="TRL's per_device_train_batch_size: one or more (default: --micro_batch_size's)")
    p.add_argument("--global_batch_tokens", type=int, default=None, metavar="N",
                   help="block tokens per optimizer step on both sides (blocks x seq_len); default: the least "
                        "multiple of every micro-batch x GPUs x seq_len")
    p.add_argument("--peer", default="trl", choices=("trl", "unsloth", "axolotl"),
                   help="the peer (sft_peers.py): TRL's SFTTrainer (full, lora, qlora), Unsloth (lora, qlora) or "
                        "axolotl (full, lora)")
    p.add_argument("--peer-env", dest="peer_env", default=None, metavar="DIR",
                   help="a `pip install --target DIR` folder put first on the peer's PYTHONPATH (Unsloth and axolotl "
                        "pin other transformers, TRL and datasets releases than ours)")
    p.add_argument("--print-config", dest="print_config", action="store_true",
                   help="print what the peer would be handed for each mode and micro-batch, as JSON, and exit (no "
                        "GPU, no peer installed)")
    p.add_argument("--lora_dropout", type=float, default=0.05, help="both sides (Unsloth's fast path wants 0)")
    p.add_argument("--peer-packing", dest="peer_packing", default="bfd", choices=("bfd", "none", "grouped"),
                   help="TRL side's rows: bfd (packed, padding-free: TRL's path with FlashAttention), none (examples "
                        "padded per micro-batch: its path for other kernels), grouped (none with "
                        "train_sampling_strategy=group_by_length)")
    add_run_arguments(p, SIDES, MODES)
    a = p.parse_args(argv)
    if a.worker:
        return worker_main(a.worker, a.result)
    from bench import gpu_count, run_job, run_jobs

    normalize_env()
    a.nproc = a.nproc or max(gpu_count(), 1)
    a.peer_micro_batch_size = a.peer_micro_batch_size or a.micro_batch_size
    counts = (("seq_len", a.seq_len), ("steps", a.steps), ("lora_rank", a.lora_rank))
    bad = [f"--{name} {value}" for name, value in counts if value < 1]
    bad += [f"micro-batch {mb}" for mb in a.micro_batch_size + a.peer_micro_batch_size if mb < 1]
    if bad or a.warmup < 0 or a.max_examples < 0:
        p.error(f"{', '.join(bad) or '--warmup/--max_examples below 0'}: give positive counts")
    workdir = Path(a.workdir) if a.workdir else Path(tempfile.mkdtemp(prefix="sft-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    from sft_peers import PEER_MODES

    unsupported = [mode for mode in a.modes if mode not in PEER_MODES[a.peer]]
    if unsupported:
        p.error(f"--modes {' '.join(unsupported)}: --peer {a.peer} runs {', '.join(PEER_MODES[a.peer])}; give those")
    try:
        global_tokens = global_batch(a)
        if a.print_config:
            from sft_peers import print_peer_config

            return print_peer_config(a, make_jobs(a, Path(a.model), workdir / "rows.jsonl", workdir / "data-cache",
                                                  global_tokens), workdir, global_tokens)
        rows, count = write_rows(a.dataset, a.max_examples, workdir / "rows.jsonl")
        model = model_directory(a.model, a.seed, workdir)
    except BenchProblem as e:
        p.error(str(e))
    log_dir = Path(a.log_dir) if a.log_dir else None
    if log_dir:
        log_dir.mkdir(parents=True, exist_ok=True)
    jobs = make_jobs(a, model, rows, workdir / "data-cache", global_tokens)
    vers = versions()
    vers["trl"] = _version("trl")
    command = "python benchmarks/sft_bench.py " + " ".join(shlex.quote(x) for x in (argv if argv is not None
                                                                                     else sys.argv[1:]))
    print(f"# {command}\n# {json.dumps(vers)}\n# {count:,} rows of {a.dataset}, model {model}, "
          f"{global_tokens:,} block tokens ({global_tokens // a.seq_len} blocks of {a.seq_len}) per optimizer step",
          flush=True)
    me = Path(__file__)
    from sft_peers import run_in_environment

    results = run_jobs(jobs, lambda job: run_in_environment(job, a.peer_env if job["side"] == "trl" else None,
                                                            lambda: run_job(job, a.nproc, a.timeout, log_dir,
                                                                            script=me)),
                       reporter(a, vers, command))
    best, record = summary(jobs, results, a.modes)
    return report(a, table(jobs, results) + "\n\n" + best, record, results, vers, command,
                  a.title or f"Supervised fine-tuning, {a.model}, {a.nproc} GPU(s)",
                  f"Data: {count:,} chat rows of {a.dataset}; {global_tokens:,} block tokens per optimizer step. "
                  "Tokens counted: the positions holding example tokens (no padding).")


def _version(name: str) -> str | None:
    from model_utils.runtime.monitor import package_version

    return package_version(name)


if __name__ == "__main__":
    sys.exit(main())
