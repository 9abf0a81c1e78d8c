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
import shlex
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import normalize_env  # noqa: E402
from fine_tuning_cli import add_run_arguments, losses_line, report, reporter, results_table  # noqa: E402
from fine_tuning_work import (IGNORE_INDEX, BenchProblem, all_ranks_sum, block_example_lengths,  # noqa: E402
                              built_run, compare_losses, figures, model_directory, timed_steps, trainer_argv,
                              work_of, worker_result)
from report import base_parameters, versions  # noqa: E402

SIDES = {"ours": "ours", "trl": "TRL SFTTrainer"}  # "trl": the peer's slot, whichever --peer fills it
MODES = ("full", "lora", "qlora")


# ----------------------------------------------------------------------------------------------------------------------
# Workers (one process per GPU; rank 0 writes the result)
# ----------------------------------------------------------------------------------------------------------------------
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
# Driver: the rows both sides read, the runs, the report
# ----------------------------------------------------------------------------------------------------------------------
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


def best_pair(jobs: list[dict], results: list[dict], mode: str):
    """Each side at its fastest micro-batch of `mode`: ((job, result) of ours, of the peer, the record both
    benchmarks' summaries start from: the two runs, the ratio by mean step time and by each side's median step, the
    losses over the same steps and each side's kernels), or None where a side did not run."""
    ours, peer = best_of(jobs, results, "ours", mode), best_of(jobs, results, "trl", mode)
    if not ours or not peer:
        return None
    ratio = ours[1]["tokens_per_s_per_gpu"] / peer[1]["tokens_per_s_per_gpu"]  # by mean step time
    # tokens/s at each side's median step, which a stall does not move: each side's mean tokens per step (the sides
    # pack the same block tokens into different example tokens) over its median step time
    median_ratio = median_tokens_per_s(ours[1]) / median_tokens_per_s(peer[1]) if (
        ours[1].get("step_s_median") and peer[1].get("step_s_median")) else None
    record = {"ours": ours[0]["name"], "peer": peer[0]["name"], "ratio": ratio, "ratio_by_median_step": median_ratio,
              "losses": compare_losses(ours[1].get("losses", []), peer[1].get("losses", [])),
              "kernels": {side: {"attention": r.get("attention"), "liger": r.get("liger")}
                          for side, r in (("ours", ours[1]), ("peer", peer[1]))}}
    return ours, peer, record


def best_pairs(jobs: list[dict], results: list[dict], modes: list[str], lines: list[str]):
    """(mode, ours, peer, record) of best_pair for each mode where both sides ran; a line in `lines` where not."""
    for mode in modes:
        pair = best_pair(jobs, results, mode)
        if pair is None:
            lines.append(f"{mode}: no pair ran")
        else:
            yield (mode, *pair)


def speed_line(mode: str, ours, peer, record: dict, name: str) -> str:
    """The summary's line of a best pair: each side's tokens/s at its micro-batch and the ratios."""
    median = record["ratio_by_median_step"]
    return (f"{mode}, best micro-batch each: ours {ours[1]['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU at "
            f"{ours[0]['micro_batch_size']}, {name} {peer[1]['tokens_per_s_per_gpu']:,.0f} at "
            f"{peer[0]['micro_batch_size']}: {record['ratio']:.2f}x by mean step time"
            + (f", {median:.2f}x by median" if median else ""))


def summary(jobs: list[dict], results: list[dict], modes: list[str]) -> tuple[str, dict]:
    """Per mode: each side at its fastest micro-batch, the ratio, and the losses of those two runs."""
    lines, record = [], {}
    for mode, ours, peer, record[mode] in best_pairs(jobs, results, modes, lines):
        name = side_label(peer[0]).split()[0]  # TRL, Unsloth, axolotl
        record[mode].update(data_loss_tokens={"ours": ours[1]["data_loss_tokens"],
                                              "peer": peer[1]["data_loss_tokens"]},
                            peer_side=peer[0].get("peer", "trl"))
        lines.append(speed_line(mode, ours, peer, record[mode], name)
                     + f" (attention: ours {ours[1].get('attention')}, {name} {peer[1].get('attention')}; Liger: "
                       f"ours {ours[1].get('liger')}, {name} {peer[1].get('liger')})")
        lines.append(f"{mode}, tokens carrying loss in the whole data: ours {ours[1]['data_loss_tokens']:,}, {name} "
                     f"{peer[1]['data_loss_tokens'] or 0:,} (equal where both mask the same tokens and truncate "
                     "nothing)")
        if record[mode]["losses"]:
            lines.append(losses_line(mode, record[mode]["losses"], name))
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
