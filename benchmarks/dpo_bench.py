#!/usr/bin/env python3
"""Preference tuning (DPO) throughput on pairs: the trainer's own path against TRL's DPOTrainer + DeepSpeed + Liger.

    python benchmarks/dpo_bench.py --model qwen3-1.7b --seq_len 1024 --global_batch_tokens 65536 \\
        --micro_batch_size 4 8 --peer-micro-batch-size 2 4 8 --modes full
    python benchmarks/dpo_bench.py --model qwen3-8b --ds_config configs/zero3.json --seq_len 1024 \\
        --global_batch_tokens 65536 --micro_batch_size 2 4 --peer-micro-batch-size 1 2 4 --modes lora
    python benchmarks/dpo_bench.py --model tiny --seq_len 96 --micro_batch_size 1 --global_batch_tokens 384 \\
        --steps 2 --warmup 1 --max_examples 32                                     # CPU smoke run

Both sides tune the same model (fine_tuning_work.model_directory: a preset written once as a random-init model, or a model
directory) on the same pair rows (the first --max_examples of --dataset: embedded-preference's training split or a
JSONL file of pairs) with DPO's sigmoid loss at --beta, each sequence cut at --seq_len tokens (TRL's max_length,
keep_start), the same DeepSpeed config, optimizer and schedule:

- Ours: the trainer's flags (--preference dpo --data_format preference) -> `make_plan` -> `check_plan` -> `build_run`
  (full fine-tuning: the reference's log-probabilities computed there, once, before the timed steps; `setup_s` holds
  that time) -> `train.preference.preference_step` + `agree_after_step`, timed per step after --warmup steps. Pairs
  are packed whole into blocks of 2 x --seq_len positions; --global_batch_tokens of blocks per optimizer step.
- Peer: TRL `DPOTrainer` with `DPOConfig(loss_type=["sigmoid"], max_length, truncation_mode="keep_start",
  precompute_ref_log_probs=True` for full fine-tuning (its way to hold one model; LoRA takes the adapters off, as
  ours does), `use_liger_kernel=True` on CUDA (TRL 1.16 applies Liger's layer kernels and keeps its own chunked LM
  head), `padding_free` where TRL supports it (1.16 turns it off and pads: `padding_free_supported`), bf16 on CUDA,
  deepspeed=the same config), `per_device_train_batch_size` pairs and the accumulation that gives the pairs per step
  ours packs into its blocks. Timed by a TrainerCallback over whole optimizer steps with CUDA synchronised.

Counted alike on both sides: the pairs and their sequences' tokens (no padding) of the timed steps; TFLOP/s and MFU by
the project's convention (report.flops_per_token: 6N per token for the forward and backward of both sequences of a
pair, plus attention within each sequence), with the reference's forward (2N per token and a third of the attention)
added where it runs in the step (LoRA); peak memory, mean and median step, pairs per second.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import host_peak_gib, normalize_env, peak_memory  # noqa: E402
from fine_tuning_cli import add_run_arguments, report, reporter, results_table  # noqa: E402
from report import base_parameters, flops_per_token, throughput, versions  # noqa: E402
from fine_tuning_work import (BenchProblem, all_ranks_max, all_ranks_sum, built_run, compare_losses,  # noqa: E402
                              liger_applied, model_directory, run_flags, segment_lengths, timed_steps, work_of,
                              worker_result)

SIDES = {"ours": "ours", "trl": "TRL DPOTrainer"}
REFERENCE_FORWARD = 1 / 3  # a forward pass's FLOPs against a forward and backward pass's


# ----------------------------------------------------------------------------------------------------------------------
# What both workers count
# ----------------------------------------------------------------------------------------------------------------------
def pair_figures(config, num_params: int, seq_len: int, pairs: int, tokens: int, area: int, times: list[float],
                 world_size: int, reference_in_step: bool) -> dict:
    """Per-GPU throughput of the timed steps from the pairs, tokens and attention pairs all ranks processed."""
    import torch

    from model_utils.models.build import gpu_peak_tflops

    steps = max(len(times), 1)
    per_gpu_step = tokens / world_size / steps
    scale = 1 + (REFERENCE_FORWARD if reference_in_step else 0)
    f12, f6 = (f * scale for f in flops_per_token(config, num_params, seq_len, area / tokens if tokens else None))
    peak = gpu_peak_tflops(torch.cuda.get_device_name()) if torch.cuda.is_available() else None
    return {"pairs_per_step": pairs / steps, "pairs_per_s": pairs / max(sum(times), 1e-9),
            "tokens_per_step_per_gpu": per_gpu_step, **throughput(per_gpu_step, times, f12, f6, peak)}


def padding_free_supported() -> bool:
    """Whether this TRL's DPOTrainer keeps `padding_free=True` (1.16 warns and falls back to padding)."""
    import inspect

    from trl import DPOTrainer

    return "temporarily unavailable" not in inspect.getsource(DPOTrainer.__init__)


# ----------------------------------------------------------------------------------------------------------------------
# Workers (one process per GPU; rank 0 writes the result)
# ----------------------------------------------------------------------------------------------------------------------
def trainer_argv(job: dict, workdir: Path) -> list[str]:
    """The trainer's flags for a job: its rows as pairs, DPO at beta, the rest as every benchmark job of ours (fine_tuning_work.run_flags)."""
    return ["--model", job["model"], "--dataset", job["rows"], "--preference", "dpo", "--beta", str(job["beta"]),
            "--data_format", "preference", *run_flags(job, workdir)]


def worker_ours(job: dict, workdir: Path) -> dict | None:
    normalize_env()
    from model_utils.train.preference import preference_step

    steps, warmup = job["steps"], job["warmup"]
    # full fine-tuning: the reference's log-probabilities computed once, in the build
    cfg, dist, run, setup_s = built_run(trainer_argv(job, workdir))
    scale = run.batch.accumulation * dist.world_size  # the step's loss: the mean over the pairs of all ranks
    times, losses, timed_blocks, gpu = timed_steps(
        run, preference_step, steps, warmup, lambda result: all_ranks_sum([result.loss_sum.item()], dist.device)[0]
        / scale)
    pairs = tokens = area = 0
    for index in timed_blocks:  # counted after the timed steps, from the host's copy of the blocks
        batch = run.data.train.batch([index])
        t, a = work_of(segment_lengths(batch.position_ids[0])[:2 * batch.num_pairs])  # the padding left out
        pairs, tokens, area = pairs + batch.num_pairs, tokens + t, area + a
    pairs, tokens, area = all_ranks_sum([pairs, tokens, area], dist.device)
    num_params = base_parameters(run.engine.module)
    out = {"side": "ours", "mode": job["mode"], "world_size": dist.world_size, "setup_s": setup_s, "losses": losses,
           "micro_batch_size": run.batch.micro, "gradient_accumulation_steps": run.batch.accumulation,
           "seq_len": job["seq_len"], "num_params": num_params, "timed_steps": len(times),
           "reference": "stored" if run.reference is not None else "adapters off",
           "attention": run.speed_in_force.get("attention_kernel", cfg.model.attn_implementation),
           "liger": run.speed_in_force.get("fused_kernels", "off"),
           **pair_figures(run.engine.module.config, num_params, job["seq_len"], int(pairs), int(tokens), int(area),
                          times, dist.world_size, reference_in_step=run.reference is None), **gpu}
    return worker_result(out, dist)


def read_rows(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def worker_trl(job: dict, workdir: Path) -> dict | None:
    normalize_env()
    from model_utils.runtime.distributed import distributed_env_problems

    assert not distributed_env_problems()
    import datasets
    import torch
    from hf_peer import optimizer_arguments, step_timer, trainer_ds_config
    from trl import DPOConfig, DPOTrainer

    from model_utils.config.flags import parse_args
    from model_utils.data.sft.formats import attach_chat_template
    from model_utils.models.build import build_model
    from model_utils.models.lora import lora_config
    from model_utils.planning.plan import make_plan

    steps, warmup, mb, mode = job["steps"], job["warmup"], job["micro_batch_size"], job["mode"]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    # Our plan for the same flags: the resolved DeepSpeed config (optimizer, schedule, clipping), LoRA and tokenizer.
    cfg = parse_args(trainer_argv(dict(job, micro_batch_size=1), workdir))
    plan = make_plan(cfg, world, on_training_hardware=True)
    raw = plan.ds_config
    tokenizer = plan.tokenizer
    attach_chat_template(tokenizer)  # the template ours renders the pairs with
    rows = datasets.Dataset.from_list(read_rows(job["rows"]))
    accumulation = max(1, round(job["peer_pairs_per_step"] / (mb * world)))
    cuda = torch.cuda.is_available()
    liger = bool(job.get("peer_liger")) and cuda  # Liger's kernels are Triton: CUDA only
    args = DPOConfig(
        output_dir=str(workdir / "trl"), per_device_train_batch_size=mb, gradient_accumulation_steps=accumulation,
        gradient_checkpointing=bool(job.get("gradient_checkpointing")),
        gradient_checkpointing_kwargs={"use_reentrant": False}, max_steps=steps + warmup, **optimizer_arguments(raw),
        warmup_steps=raw.get("scheduler", {}).get("params", {}).get("warmup_num_steps", 0), bf16=cuda,
        deepspeed=trainer_ds_config(raw), use_liger_kernel=liger, loss_type=["sigmoid"], beta=job["beta"],
        max_length=job["seq_len"], truncation_mode="keep_start", padding_free=padding_free_supported(),
        precompute_ref_log_probs=mode == "full", logging_steps=1, logging_nan_inf_filter=False, save_strategy="no",
        report_to="none", disable_tqdm=True, seed=job["seed"], dataloader_num_workers=2 if cuda else 0,
        use_cpu=not cuda)
    model = build_model(job["model"], plan.model.config, torch.float32, job.get("peer_attn", "sdpa"), False)
    lora = cfg.model.lora_settings()
    timer = step_timer(warmup, steps, rank)
    trainer = DPOTrainer(model=model, args=args, train_dataset=rows, processing_class=tokenizer,
                         peft_config=lora_config(plan.model.config, lora) if lora else None, callbacks=[timer])
    timed = []  # per policy forward of a timed step: its rows' token counts (on the device)

    def count(module, positional, kwargs):
        """The policy's training forwards (not the reference's, under no_grad): each row's tokens, not padding."""
        if module.training and torch.is_grad_enabled() and len(timer.times) >= warmup:
            timed.append(kwargs["attention_mask"].sum(-1))

    trainer.model.register_forward_pre_hook(count, with_kwargs=True)
    trainer.train()
    gpu = timer.finish()
    lengths = [int(n) for rows_lengths in timed for n in rows_lengths.cpu().tolist()]
    tokens, area = work_of(lengths)
    pairs, tokens, area = all_ranks_sum([len(lengths) // 2, tokens, area], trainer.args.device)
    num_params = base_parameters(trainer.model)
    out = {"side": "trl", "mode": mode, "world_size": world, "losses": timer.losses, "micro_batch_size": mb,
           "gradient_accumulation_steps": accumulation, "seq_len": job["seq_len"], "num_params": num_params,
           "timed_steps": len(timer.times[warmup:]), "padding_free": trainer.padding_free,
           "reference": "precomputed" if mode == "full" else "adapters off",
           "liger": liger and liger_applied(trainer.model),
           "attention": getattr(trainer.model.config, "_attn_implementation", job.get("peer_attn", "sdpa")),
           **pair_figures(plan.model.config, num_params, job["seq_len"], int(pairs), int(tokens), int(area),
                          timer.times[warmup:], world, reference_in_step=mode == "lora"),
           **peak_memory(), **gpu}
    if "peak_mem_gib" in out:
        out["peak_mem_gib"] = all_ranks_max(out["peak_mem_gib"], trainer.args.device)
    out["host_peak_gib"] = all_ranks_max(host_peak_gib(), trainer.args.device)
    return out if rank == 0 else None


def worker_main(job_json: str, result_path: str) -> int:
    job = json.loads(job_json)
    with tempfile.TemporaryDirectory(prefix="dpo-bench-") as tmp:
        result = (worker_ours if job["side"] == "ours" else worker_trl)(job, Path(tmp))
    if result is not None:
        Path(result_path).write_text(json.dumps(result))
    return 0


# ----------------------------------------------------------------------------------------------------------------------
# Driver: the rows both sides read, the pairs per step, the runs, the report
# ----------------------------------------------------------------------------------------------------------------------
def write_rows(dataset: str, max_examples: int, out: Path) -> tuple[Path, int]:
    """The first `max_examples` pair rows (0: all) of --dataset as JSONL at `out`, each checked as a pair
    (data.preference.formats.check_pair_row); returns the file and its row count."""
    from model_utils.data.chat_corpus import build_preference_corpus, split_files
    from model_utils.data.errors import DataError
    from model_utils.data.preference.formats import check_pair_row

    source = split_files(build_preference_corpus())["train"] if dataset == "embedded-preference" else dataset
    if not Path(source).is_file():
        raise BenchProblem(f"--dataset {dataset}: no such file; give a JSONL file of pairs (prompt, chosen, rejected "
                           "per line) or embedded-preference")
    rows = []
    with open(source, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                check_pair_row(row, number, dataset)
            except json.JSONDecodeError as e:
                raise BenchProblem(f"--dataset {dataset}: line {number} is not JSON ({e.msg})") from e
            except DataError as e:
                raise BenchProblem(str(e.problem)) from e
            rows.append(row)
            if max_examples and len(rows) == max_examples:
                break
    if not rows:
        raise BenchProblem(f"--dataset {dataset}: holds no rows; give a JSONL file of pairs")
    out.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
    return out, len(rows)


def pairs_per_block(rows: Path, model: Path, seq_len: int) -> float:
    """How many pairs our blocks of 2 x seq_len hold on average, packed as the trainer packs them: the peer's pairs per
    step follow from it."""
    from model_utils.data.preference.encode import PairEncoder
    from model_utils.data.preference.packing import pack_pairs
    from model_utils.data.sft.formats import attach_chat_template
    from model_utils.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(str(model))
    attach_chat_template(tokenizer)
    encoder = PairEncoder(tokenizer)
    stats = pack_pairs((encoder.encode(row, n) for n, row in enumerate(read_rows(str(rows)), 1)), seq_len, 0,
                       len(tokenizer)).stats
    return stats.pairs / max(stats.blocks, 1)


def global_batch(a) -> int:
    """--global_batch_tokens (block tokens per step, ours), checked against every micro-batch of ours; default: the
    least that each makes whole optimizer steps of."""
    per_micro = {mb: mb * a.nproc * 2 * a.seq_len for mb in sorted(set(a.micro_batch_size))}
    if not a.global_batch_tokens:
        return math.lcm(*per_micro.values())
    for mb, tokens in per_micro.items():
        if a.global_batch_tokens % tokens:
            raise BenchProblem(f"--global_batch_tokens {a.global_batch_tokens}: not a multiple of micro-batch {mb} x "
                               f"{a.nproc} GPU(s) x a block of 2 x seq_len {a.seq_len} = {tokens} tokens")
    return a.global_batch_tokens


def make_jobs(a, model: Path, rows: Path, data_cache: Path, global_tokens: int, peer_pairs: float) -> list[dict]:
    """Per mode: ours at each --micro_batch_size, then the peer at each --peer-micro-batch-size."""
    base = {"model": str(model), "rows": str(rows), "data_cache": str(data_cache), "seq_len": a.seq_len,
            "global_batch_tokens": global_tokens, "peer_pairs_per_step": peer_pairs, "steps": a.steps,
            "warmup": a.warmup, "seed": a.seed, "beta": a.beta, "ds_config": a.ds_config, "zero_stage": a.zero_stage,
            "ds_set": a.ds_set, "gradient_checkpointing": a.gradient_checkpointing, "lora_rank": a.lora_rank,
            "lora_alpha": a.lora_alpha, "lora_target_modules": a.lora_target_modules,
            "peer_liger": a.peer_liger == "on", "peer_attn": a.peer_attn, "attention_kernel": a.attention_kernel}
    jobs = []
    for mode in a.modes:
        for side, micro_batches in (("ours", a.micro_batch_size), ("trl", a.peer_micro_batch_size)):
            for mb in [] if side in a.skip else micro_batches:
                jobs.append(dict(base, side=side, mode=mode, micro_batch_size=mb, variant=f"{side}-{mode}",
                                 name=f"{side}-{mode}-mb{mb}"))
    return jobs


def table(jobs: list[dict], results: list[dict]) -> str:
    return results_table(jobs, results, lambda job: SIDES[job["side"]], [
        ("pairs/s", lambda r: f"{r['pairs_per_s']:,.1f}"),
        ("tokens/s/GPU", lambda r: f"{r['tokens_per_s_per_gpu']:,.0f}"),
        ("TFLOP/s/GPU", lambda r: f"{r['tflops_per_gpu']:.0f}")],
        [("pairs/step", lambda r: f"{r['pairs_per_step']:,.1f}")])


def summary(jobs: list[dict], results: list[dict], modes: list[str]) -> tuple[str, dict]:
    """Per mode: each side at its fastest micro-batch (by pairs per second), the ratio, and the losses."""
    lines, record = [], {}
    for mode in modes:
        best = {}
        for side in SIDES:
            ran = [(j, r) for j, r in zip(jobs, results) if j["side"] == side and j["mode"] == mode and "error" not in r]
            best[side] = max(ran, key=lambda jr: jr[1]["pairs_per_s"], default=None)
        if not all(best.values()):
            lines.append(f"{mode}: no pair ran")
            continue
        (ours_job, ours), (peer_job, peer) = best["ours"], best["trl"]
        ratio = ours["pairs_per_s"] / peer["pairs_per_s"]
        losses = compare_losses(ours.get("losses", []), peer.get("losses", []))
        record[mode] = {"ours": ours_job["name"], "peer": peer_job["name"], "ratio_pairs_per_s": ratio,
                        "losses": losses, "kernels": {side: {"attention": r.get("attention"), "liger": r.get("liger")}
                                                      for side, r in (("ours", ours), ("peer", peer))}}
        lines.append(f"{mode}, best micro-batch each: ours {ours['pairs_per_s']:,.1f} pairs/s at "
                     f"{ours_job['micro_batch_size']}, TRL {peer['pairs_per_s']:,.1f} at {peer_job['micro_batch_size']}"
                     f": {ratio:.2f}x (reference: ours {ours['reference']}, TRL {peer['reference']}; TRL padding_free "
                     f"{peer['padding_free']})")
    return "\n".join(lines), record


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-1.7b", help="a preset (written once as a random-init model under "
                                                          "--workdir) or a Hugging Face model directory")
    p.add_argument("--dataset", default="embedded-preference", help="embedded-preference, or a JSONL file of pairs")
    p.add_argument("--max_examples", type=int, default=0, help="the first N rows (0: all)")
    p.add_argument("--seq_len", type=int, default=1024, help="the most tokens of one sequence (TRL's max_length); "
                                                            "ours' blocks hold 2 x seq_len")
    p.add_argument("--beta", type=float, default=0.1)
    p.add_argument("--micro_batch_size", type=int, nargs="+", default=[4], help="ours (blocks): one or more")
    p.add_argument("--peer-micro-batch-size", dest="peer_micro_batch_size", type=int, nargs="+", default=None,
                   help="TRL's per_device_train_batch_size (pairs): one or more (default: --micro_batch_size's)")
    p.add_argument("--global_batch_tokens", type=int, default=None, metavar="N",
                   help="block tokens per optimizer step of ours; TRL takes as many pairs per step as they hold")
    add_run_arguments(p, SIDES)
    a = p.parse_args(argv)
    if a.worker:
        return worker_main(a.worker, a.result)
    from bench import gpu_count, run_job, run_jobs

    normalize_env()
    a.nproc = a.nproc or max(gpu_count(), 1)
    a.peer_micro_batch_size = a.peer_micro_batch_size or a.micro_batch_size
    if min(a.seq_len, a.steps, a.lora_rank, *a.micro_batch_size, *a.peer_micro_batch_size) < 1 or a.warmup < 0:
        p.error("--seq_len, --steps, --lora_rank and the micro-batches must be positive, --warmup 0 or more")
    workdir = Path(a.workdir) if a.workdir else Path(tempfile.mkdtemp(prefix="dpo-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        global_tokens = global_batch(a)
        rows, count = write_rows(a.dataset, a.max_examples, workdir / "rows.jsonl")
        model = model_directory(a.model, a.seed, workdir)
    except BenchProblem as e:
        p.error(str(e))
    peer_pairs = global_tokens // (2 * a.seq_len) * pairs_per_block(rows, model, a.seq_len)
    log_dir = Path(a.log_dir) if a.log_dir else None
    if log_dir:
        log_dir.mkdir(parents=True, exist_ok=True)
    jobs = make_jobs(a, model, rows, workdir / "data-cache", global_tokens, peer_pairs)
    vers = versions()
    vers["trl"] = _version("trl")
    command = "python benchmarks/dpo_bench.py " + " ".join(shlex.quote(x) for x in (argv if argv is not None
                                                                                     else sys.argv[1:]))
    print(f"# {command}\n# {json.dumps(vers)}\n# {count:,} pairs of {a.dataset}, model {model}, {global_tokens:,} block "
          f"tokens per optimizer step (~{peer_pairs:.1f} pairs)", flush=True)
    results = run_jobs(jobs, lambda job: run_job(job, a.nproc, a.timeout, log_dir, script=Path(__file__)),
                       reporter(a, vers, command))
    best, record = summary(jobs, results, a.modes)
    return report(a, table(jobs, results) + "\n\n" + best, record, results, vers, command,
                  a.title or f"Preference tuning (DPO), {a.model}, {a.nproc} GPU(s)",
                  f"Data: {count:,} pairs of {a.dataset}; {global_tokens:,} block tokens per optimizer step (~"
                  f"{peer_pairs:.1f} pairs).")


def _version(name: str) -> str | None:
    from model_utils.runtime.monitor import package_version

    return package_version(name)


if __name__ == "__main__":
    sys.exit(main())
