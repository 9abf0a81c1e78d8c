#!/usr/bin/env python3
"""Vision-language fine-tuning throughput on image chats: the trainer's own path against TRL's SFTTrainer for
vision-language models (vlm_peer.py).

    python benchmarks/vlm_bench.py --model qwen2.5-vl-7b --seq_len 4096 --global_batch_tokens 32768 \\
        --micro_batch_size 2 4 --peer-micro-batch-size 4 8 --modes lora --gradient_checkpointing
    python benchmarks/vlm_bench.py --model tiny-vl --seq_len 256 --micro_batch_size 1 --peer-micro-batch-size 1 \\
        --steps 2 --warmup 1 --max_examples 32 --modes full lora                   # CPU smoke run

Both sides train the same model on the same rows with the same optimizer, schedule and DeepSpeed config, the same
parts frozen (--freeze, default the vision tower, ours' default) and the same adapters, as sft_bench.py does for text:

- Model: a vision preset (tiny-vl, qwen2.5-vl-7b) is written once under --workdir as a random-init Hugging Face model
  directory (bf16, initialised on the GPU where there is one) with its processor (fine_tuning_work.model_directory);
  a model directory is used as it is. Ours: `--model DIR`; TRL: `AutoModelForImageTextToText.from_pretrained(DIR)`
  and DIR's processor. Both resize images within the same pixel bound (--max_image_pixels, default ours': a quarter
  of a block's tokens), so an image is the same tokens on both sides.
- Rows (--workdir/vlm-rows: train.jsonl and images/, TRL's layout, written once per seed and count): --max_examples
  image chats, about one in ten without an image (the path where a micro-batch may hold none), the others with one
  picture of coloured rectangles of a random size from 224x224 to 672x448 pixels (multiples of 28); the system prompt
  and question of one of the embedded chats (data.chat_corpus) and an answer of its chats' answers cut at a
  log-uniform 20 to 400 tokens (at most half of --seq_len, so that no example is cut).
- Ours: vlm_peer.vlm_argv (`--model DIR --dataset ROWS --freeze --max_image_pixels` and the flags every benchmark run
  takes: --validation_fraction 0, the batch, --lora_rank for LoRA) -> built as main() builds a run
  (fine_tuning_work.built_run) -> `train_step` + `agree_after_step`, timed per step after --warmup steps. Examples
  are packed whole into blocks of --seq_len (best fit, the rest of a block padding); --global_batch_tokens of blocks
  per optimizer step.
- Peer: TRL's SFTTrainer for vision-language models (vlm_peer.py says how and what TRL refuses: packing, padding-free
  rows, and below transformers 5.18 the assistant-only loss), --peer-micro-batch-size examples per micro-batch padded
  to the longest, and as many examples per optimizer step as the block tokens of ours' step hold at the rows' mean
  length (sft_peers.examples_accumulation). Timed by a TrainerCallback over whole optimizer steps.

Counted alike on both sides over the timed steps: the tokens of the examples (image tokens included, no padding; ours
counts an example's n - 1 shifted positions, TRL its n) and each side's padding share (ours: the ends of its blocks;
TRL: each micro-batch padded to its longest row); TFLOP/s and MFU by the project's convention for the language model
(report.flops_per_token: 6N over those tokens, N the language model's matrix parameters without adapters, plus
attention within each example) plus the vision tower's and projector's (models.vision.flops.VisionFlops: a frozen
tower 2N per patch, a trained one 6N, the projector per image token); peak GPU memory; the losses (compare_losses:
the steps see different examples, so their means over the same steps compare, not step by step).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shlex
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import normalize_env  # noqa: E402
from fine_tuning_cli import add_run_arguments, losses_line, report, reporter, results_table  # noqa: E402
from fine_tuning_work import (IGNORE_INDEX, BenchProblem, all_ranks_sum, block_example_lengths,  # noqa: E402
                              built_run, figures, model_directory, read_rows, timed_steps, work_of,
                              worker_result)
from report import versions  # noqa: E402
from sft_bench import best_pairs, global_batch, side_label, speed_line  # noqa: E402
from sft_peers import examples_accumulation  # noqa: E402
from vlm_peer import image_tokens_of, vision_fields, vlm_argv  # noqa: E402

SIDES = {"ours": "ours", "trl": "TRL SFTTrainer"}
MODES = ("full", "lora")
ROWS_VERSION = 1  # of the rows' generator: raise it whenever a change here changes the rows or pictures
TEXT_ONLY_PERCENT = 10
WIDTHS, HEIGHTS = range(224, 673, 28), range(224, 449, 28)
ANSWER_TOKENS = (20, 400)


# ----------------------------------------------------------------------------------------------------------------------
# Our worker (one process per GPU; rank 0 writes the result); TRL's is vlm_peer.worker_trl
# ----------------------------------------------------------------------------------------------------------------------
def worker_ours(job: dict, workdir: Path) -> dict | None:
    normalize_env()
    import numpy as np

    from model_utils.train.step import train_step

    # the data checked by the run as main() builds it: the preflight's data check reads rows with images as text
    cfg, dist, run, setup_s = built_run(vlm_argv(job, workdir), check_data=False)
    vision, data, warmup = run.vision, run.data.train, job["warmup"]
    vision_flops = []

    def loss_of(result) -> float:  # this rank's mean over its micro-batches; the step's tower and projector FLOPs kept
        vision_flops.append(result.vision_flops)
        return result.loss_sum.item() / run.batch.accumulation

    times, losses, timed_blocks, gpu = timed_steps(run, train_step, job["steps"], warmup, loss_of)
    tokens = area = loss_tokens = images = image_tokens = examples = 0
    for index in timed_blocks:  # counted after the timed steps, from the host's copy of the blocks (no image read)
        block = data.batch([index])
        lengths = block_example_lengths(block.position_ids[0], block.targets[0])
        t, a = work_of(lengths)
        tokens, area, loss_tokens = tokens + t, area + a, loss_tokens + block.loss_tokens
        images, examples = images + len(block.image_files), examples + len(lengths)
        image_tokens += int((block.input_ids == data.image_token_id).sum())
    positions = len(timed_blocks) * run.batch.seq_len
    tokens, area, loss_tokens, images, image_tokens, examples, positions, extra = all_ranks_sum(
        [tokens, area, loss_tokens, images, image_tokens, examples, positions, sum(vision_flops[warmup:])], dist.device)
    lm_params = vision.part_params["language_model"]
    out = {"side": "ours", "mode": job["mode"], "world_size": dist.world_size, "setup_s": setup_s, "losses": losses,
           "data_loss_tokens": int((np.asarray(data.targets) != IGNORE_INDEX).sum()),  # every block trains
           "data_image_tokens": int((np.asarray(data.tokens) == data.image_token_id).sum()),
           "micro_batch_size": run.batch.micro, "gradient_accumulation_steps": run.batch.accumulation,
           "seq_len": run.batch.seq_len, "blocks_per_step": run.batch.micro * run.batch.accumulation * dist.world_size,
           "examples_per_step": examples / max(len(times), 1), "num_params": lm_params,
           "parts": vision.part_params, "frozen": list(vision.frozen), "timed_steps": len(times),
           "attention": run.speed_in_force.get("attention_kernel", cfg.model.attn_implementation),
           "liger": run.speed_in_force.get("fused_kernels", "off"),
           **figures(vision.config.get_text_config(), lm_params, run.batch.seq_len, int(tokens), int(area),
                     int(loss_tokens), times, dist.world_size, extra),
           **vision_fields(positions, tokens, images, image_tokens, len(times), dist.world_size), **gpu}
    return worker_result(out, dist)


def worker_main(job_json: str, result_path: str) -> int:
    from vlm_peer import worker_trl

    job = json.loads(job_json)
    worker = worker_ours if job["side"] == "ours" else worker_trl
    with tempfile.TemporaryDirectory(prefix="vlm-bench-") as tmp:
        result = worker(job, Path(tmp))
    if result is not None:
        Path(result_path).write_text(json.dumps(result))
    return 0


# ----------------------------------------------------------------------------------------------------------------------
# The rows both sides read
# ----------------------------------------------------------------------------------------------------------------------
def picture(rng: random.Random):
    """A picture of a random size (WIDTHS x HEIGHTS) on a light background with 1 to 6 filled rectangles."""
    from PIL import Image, ImageDraw

    width, height = rng.choice(WIDTHS), rng.choice(HEIGHTS)
    image = Image.new("RGB", (width, height), tuple(rng.randint(200, 255) for _ in range(3)))
    pen = ImageDraw.Draw(image)
    for _ in range(rng.randint(1, 6)):
        left, top = rng.randrange(width - 20), rng.randrange(height - 20)
        pen.rectangle((left, top, rng.randint(left + 10, width - 1), rng.randint(top + 10, height - 1)),
                      fill=tuple(rng.randrange(256) for _ in range(3)))
    return image


def answer_text(answers: list[str], start: int, target: int, tokenizer) -> str:
    """About `target` tokens of the chats' answers from the `start`th on, joined by blank lines, cut after a
    token."""
    text, at = "", start
    while True:
        text = (text + "\n\n" if text else "") + answers[at % len(answers)]
        at += 1
        offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
        if len(offsets) >= target:
            return text[:offsets[target - 1][1]]


def write_rows(out_dir: Path, count: int, seed: int, tokenizer, seq_len: int) -> Path:
    """The rows (module docstring) as `out_dir`/train.jsonl and images/, written once for these settings (meta.json,
    written last, says which); returns the JSONL file."""
    from model_utils.data.chat_corpus import build_sft_corpus, split_files
    from model_utils.data.tokens import tokenizer_identity

    low, high = ANSWER_TOKENS[0], max(ANSWER_TOKENS[0], min(ANSWER_TOKENS[1], seq_len // 2))
    meta = {"version": ROWS_VERSION, "rows": count, "seed": seed, "answer_tokens": [low, high],
            "tokenizer": tokenizer_identity(tokenizer)}
    rows_file, meta_file = out_dir / "train.jsonl", out_dir / "meta.json"
    if meta_file.is_file() and json.loads(meta_file.read_text()) == meta and rows_file.is_file():
        return rows_file
    chats = [row["messages"] for row in read_rows(split_files(build_sft_corpus())["train"])]
    answers = [chat[-1]["content"] for chat in chats]
    rng = random.Random(seed)
    (out_dir / "images").mkdir(parents=True, exist_ok=True)
    rows = []
    for index in range(count):
        chat = chats[index % len(chats)]
        system, question = (next(m["content"] for m in chat if m["role"] == role) for role in ("system", "user"))
        target = round(math.exp(rng.uniform(math.log(low), math.log(high))))  # more short answers than long
        user, images = [{"type": "text", "text": question}], []
        if rng.randrange(100) >= TEXT_ONLY_PERCENT:
            images = [f"images/{index:06d}.png"]
            picture(rng).save(out_dir / images[0])
            user.insert(0, {"type": "image"})
        rows.append({"messages": [{"role": "system", "content": [{"type": "text", "text": system}]},
                                  {"role": "user", "content": user},
                                  {"role": "assistant", "content": [
                                      {"type": "text", "text": answer_text(answers, index, target, tokenizer)}]}],
                     "images": images})
    tmp = rows_file.with_name(f"train.jsonl.tmp-{os.getpid()}")
    tmp.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
    os.replace(tmp, rows_file)
    meta_file.write_text(json.dumps(meta))
    return rows_file


def row_lengths(processor, rows_file: Path) -> list[tuple[int, int, int]]:
    """Per row (tokens, image tokens, images) as both sides render it: the processor's chat template, each image's
    token written as its tokens (vlm_peer.image_tokens_of)."""
    from model_utils.data.vision.formats import rendered, row_messages
    from model_utils.data.vision.processor import chat_template_of

    template, out = chat_template_of(processor), []
    rows = read_rows(str(rows_file))
    for number, (row, counts) in enumerate(zip(rows, image_tokens_of(processor, rows_file)), start=1):
        messages, images = row_messages(row, "chat", number, str(rows_file))
        ids = processor.tokenizer.apply_chat_template(rendered(messages), chat_template=template, tokenize=True,
                                                      return_dict=False)
        out.append((len(ids) - len(images) + sum(counts), sum(counts), len(images)))
    return out


def not_vision(model) -> BenchProblem:
    return BenchProblem(f"--model {model}: not a vision-language model; give a vision preset (tiny-vl, qwen2.5-vl-7b) "
                        "or a model directory that AutoModelForImageTextToText loads")


def vision_processor(model: Path, seq_len: int, max_pixels: int | None):
    """(DIR's processor as ours loads it, the pixel bound both sides resize images within: --max_image_pixels, else
    ours' default, a quarter of a block's tokens; None where the image processor has a fixed size)."""
    from transformers import AutoConfig

    from model_utils.data.vision.processor import load_processor, set_image_pixels
    from model_utils.models.vision.build import is_vision_model
    from model_utils.planning.vision import default_max_pixels

    if not is_vision_model(str(model)):
        raise not_vision(model)
    processor = load_processor(str(model), AutoConfig.from_pretrained(model).model_type)
    pixels = max_pixels or default_max_pixels(processor, seq_len)[0]
    return processor, pixels if set_image_pixels(processor, pixels, None) else None


# ----------------------------------------------------------------------------------------------------------------------
# Driver: the jobs, the report
# ----------------------------------------------------------------------------------------------------------------------
def make_jobs(a, model: Path, rows: Path, global_tokens: int, mean_tokens: float, max_pixels: int | None) -> list[dict]:
    """Per mode: ours at each --micro_batch_size, then TRL at each --peer-micro-batch-size."""
    base = {"model": str(model), "rows": str(rows), "data_cache": str(Path(a.workdir) / "data-cache"),
            "seq_len": a.seq_len, "global_batch_tokens": global_tokens, "steps": a.steps, "warmup": a.warmup,
            "seed": a.seed, "ds_config": a.ds_config, "zero_stage": a.zero_stage, "ds_set": a.ds_set,
            "gradient_checkpointing": a.gradient_checkpointing, "lora_rank": a.lora_rank, "lora_alpha": a.lora_alpha,
            "lora_target_modules": a.lora_target_modules, "peer_liger": a.peer_liger == "on",
            "peer_attn": a.peer_attn, "attention_kernel": a.attention_kernel, "freeze": a.freeze,
            "max_image_pixels": max_pixels}
    jobs = []
    for mode in a.modes:
        for side, micro_batches in (("ours", a.micro_batch_size), ("trl", a.peer_micro_batch_size)):
            for mb in micro_batches if side not in a.skip else []:
                if side == "ours":
                    accumulation, extra = global_tokens // (mb * a.nproc * a.seq_len), {}
                else:
                    accumulation = examples_accumulation(global_tokens, mean_tokens, mb * a.nproc)
                    extra = {"peer_accumulation": accumulation}
                jobs.append(dict(base, side=side, mode=mode, micro_batch_size=mb, **extra, variant=f"{side}-{mode}",
                                 name=f"{side}-{mode}-mb{mb}-ga{accumulation}"))
    return jobs


def table(jobs: list[dict], results: list[dict]) -> str:
    return results_table(jobs, results, side_label, [
        ("tokens/s/GPU", lambda r: f"{r['tokens_per_s_per_gpu']:,.0f}"),
        ("TFLOP/s/GPU (vision)", lambda r: f"{r['tflops_per_gpu']:.1f} ({r.get('extra_tflops_per_gpu', 0):.1f})")],
        [("tokens/step/GPU", lambda r: f"{r['tokens_per_step_per_gpu']:,.0f}"),
         ("padding", lambda r: f"{100 * r['padding_share']:.1f}%"),
         ("images/step/GPU", lambda r: f"{r['images_per_step_per_gpu']:,.1f}"),
         ("loss tokens/step/GPU", lambda r: f"{r['loss_tokens_per_step_per_gpu']:,.0f}")])


def summary(jobs: list[dict], results: list[dict], modes: list[str]) -> tuple[str, dict]:
    """Per mode: each side at its fastest micro-batch, the ratio, their padding, kernels and losses."""
    lines, record = [], {}
    for mode, (oj, o), (pj, t), record[mode] in best_pairs(jobs, results, modes, lines):
        losses = record[mode]["losses"]
        record[mode].update(padding_share={"ours": o["padding_share"], "peer": t["padding_share"]},
                            peer_assistant_only_loss=t.get("assistant_only_loss"),
                            peer_refused=t.get("assistant_only_loss_refused"), peer_processor=t.get("processor"),
                            data_image_tokens={"ours": o["data_image_tokens"], "peer": t["data_image_tokens"]})
        lines.append(speed_line(mode, (oj, o), (pj, t), record[mode], "TRL")
                     + f"; padding ours {100 * o['padding_share']:.1f}%, TRL {100 * t['padding_share']:.1f}% "
                       f"(attention: ours {o.get('attention')}, TRL {t.get('attention')} [{t.get('attention_why')}]; "
                       f"Liger: ours {o.get('liger')}, TRL {t.get('liger')} [{t.get('liger_why')}])")
        lines.append(f"{mode}, image tokens of the whole data: ours {o['data_image_tokens']:,}, TRL "
                     f"{t['data_image_tokens']:,} (equal where both resize the images alike)")
        if losses:
            loss_of = "the answers" if t.get("assistant_only_loss") else "every token (assistant-only refused)"
            lines.append(losses_line(mode, losses, "TRL", f"; TRL's loss on {loss_of}"))
    return "\n".join(lines), record


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-vl-7b", help="a vision preset (written once as a random-init model "
                                                             "under --workdir) or a vision-language model directory")
    p.add_argument("--max_examples", type=int, default=3000, help="rows written and read")
    p.add_argument("--seq_len", type=int, default=4096, help="ours' block length")
    p.add_argument("--micro_batch_size", type=int, nargs="+", default=[2], help="ours (blocks): one or more")
    p.add_argument("--peer-micro-batch-size", dest="peer_micro_batch_size", type=int, nargs="+", default=[4],
                   help="TRL's per_device_train_batch_size (examples, padded to the longest): one or more")
    p.add_argument("--global_batch_tokens", type=int, default=None, metavar="N",
                   help="ours' block tokens per optimizer step (TRL: as many examples as they hold at the rows' mean "
                        "length); default: the least multiple of every micro-batch x GPUs x seq_len")
    p.add_argument("--freeze", default="vision_tower", help="the parts neither side trains (ours' --freeze)")
    p.add_argument("--max_image_pixels", type=int, default=None,
                   help="the pixels both sides resize an image within (default: ours', a quarter of a block's tokens)")
    add_run_arguments(p, SIDES, MODES)
    p.set_defaults(peer_attn="auto")  # vlm_peer.peer_attention: FlashAttention 2 where importable, else sdpa
    a = p.parse_args(argv)
    if a.worker:
        return worker_main(a.worker, a.result)
    from bench import gpu_count, run_job, run_jobs

    from model_utils.config.presets import is_preset, is_vision_preset

    normalize_env()
    a.nproc = a.nproc or max(gpu_count(), 1)
    a.peer_packing = "none"  # for sft_bench.global_batch: TRL's micro-batches are padded examples
    bad = [f"--{name} {value}" for name, value in (("seq_len", a.seq_len), ("steps", a.steps),
                                                   ("max_examples", a.max_examples)) if value < 1]
    bad += [f"micro-batch {mb}" for mb in a.micro_batch_size + a.peer_micro_batch_size if mb < 1]
    if bad or a.warmup < 0:
        p.error(f"{', '.join(bad) or '--warmup below 0'}: give positive counts")
    a.workdir = a.workdir or tempfile.mkdtemp(prefix="vlm-bench-")
    workdir = Path(a.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        global_tokens = global_batch(a)
        if is_preset(a.model) and not is_vision_preset(a.model):  # refused before a text preset is written
            raise not_vision(a.model)
        model = model_directory(a.model, a.seed, workdir)
        processor, max_pixels = vision_processor(model, a.seq_len, a.max_image_pixels)
    except BenchProblem as e:
        p.error(str(e))
    rows = write_rows(workdir / "vlm-rows", a.max_examples, a.seed, processor.tokenizer, a.seq_len)
    lengths = row_lengths(processor, rows)
    mean_tokens = sum(n for n, _, _ in lengths) / len(lengths)
    log_dir = Path(a.log_dir) if a.log_dir else None
    if log_dir:
        log_dir.mkdir(parents=True, exist_ok=True)
    jobs = make_jobs(a, model, rows, global_tokens, mean_tokens, max_pixels)
    from model_utils.runtime.monitor import package_version

    vers = dict(versions(), trl=package_version("trl"), torchvision=package_version("torchvision"))
    command = "python benchmarks/vlm_bench.py " + " ".join(shlex.quote(x) for x in (argv if argv is not None
                                                                                     else sys.argv[1:]))
    with_images = sum(1 for *_, images in lengths if images)
    image_share = sum(t for _, t, _ in lengths) / sum(n for n, *_ in lengths)
    resized = f"within {max_pixels:,} pixels" if max_pixels else "by the image processor alone"
    data_line = (f"{len(lengths):,} rows ({with_images:,} with an image, {len(lengths) - with_images:,} without), "
                 f"{mean_tokens:,.0f} tokens per example on average ({100 * image_share:.0f}% image tokens), images "
                 f"resized {resized}; {global_tokens:,} block tokens ({global_tokens // a.seq_len} x {a.seq_len}) "
                 "per optimizer step")
    print(f"# {command}\n# {json.dumps(vers)}\n# model {model}; {data_line}", flush=True)
    me = Path(__file__)
    results = run_jobs(jobs, lambda job: run_job(job, a.nproc, a.timeout, log_dir, script=me),
                       reporter(a, vers, command))
    best, record = summary(jobs, results, a.modes)
    return report(a, table(jobs, results) + "\n\n" + best, record, results, vers, command,
                  a.title or f"Vision-language fine-tuning, {a.model}, {a.nproc} GPU(s)",
                  f"Data: {data_line}. Tokens counted: the examples' tokens, image tokens included (no padding).")


if __name__ == "__main__":
    sys.exit(main())
