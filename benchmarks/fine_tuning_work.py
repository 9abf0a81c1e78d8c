"""What the fine-tuning benchmarks' drivers and workers share (sft_bench.py, its peers in sft_peers.py, dpo_bench.py):
the model both sides load, the rows they read, the trainer's flags and run as its main() builds them, the timed steps,
the example tokens and attention pairs counted alike on both sides, the collectives that sum them over the ranks, and
the result with every rank's peak memory."""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

from common import cuda_sync, ds_config_for, host_peak_gib, peak_memory
from report import flops_per_token, throughput
from telemetry import GpuTelemetry

IGNORE_INDEX = -100
LOSSES_SHOWN = 5  # first losses printed per side


# ----------------------------------------------------------------------------------------------------------------------
# The model and the rows both sides read
# ----------------------------------------------------------------------------------------------------------------------
class BenchProblem(Exception):
    """Input the benchmark cannot run with; the message names it and says what to do."""


def model_directory(model: str, seed: int, workdir: Path) -> Path:
    """The model both sides load: a preset written once under `workdir` as a random-init Hugging Face model (bf16,
    the run's tokenizer with the chat template ours renders with; a vision preset with its processor:
    `vision_model_directory`), or the directory given."""
    from model_utils.config.presets import is_preset, is_vision_preset, preset_names

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
    if is_vision_preset(model):
        return vision_model_directory(model, seed, out)
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


def vision_model_directory(preset: str, seed: int, out: Path) -> Path:
    """A vision preset written to `out` as a random-init Hugging Face model (bf16, AutoModelForImageTextToText from
    models.vision.build's config) with its processor (tokenizer, image processor, chat template). Its processor is
    built image-only (data.vision.processor.image_only) and saved without a video processor, which transformers'
    AutoProcessor asks for: the entry the Qwen-VL family's processors save for theirs is added (from the image
    processor's patch settings), so AutoProcessor loads the directory where torchvision is installed, and elsewhere
    fails with ImportError, from which data.vision.processor.load_processor builds it image-only."""
    import torch
    from transformers import AutoModelForImageTextToText

    from model_utils.data.vision.processor import preset_processor
    from model_utils.models.vision.build import vision_model_config
    from model_utils.runtime.process import seed_everything

    processor = preset_processor()
    seed_everything(seed)
    # initialised on the GPU where there is one: a 7B model's random init takes minutes on a host's CPU
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        built = AutoModelForImageTextToText.from_config(vision_model_config(preset, processor), dtype=torch.bfloat16)
    tmp = out.with_name(out.name + ".tmp")
    built.save_pretrained(tmp)
    processor.save_pretrained(tmp)
    saved = tmp / "processor_config.json"
    settings = json.loads(saved.read_text())
    if "video_processor" not in settings:  # a preset is a Qwen2.5-VL model, whose processor takes one
        image = settings.get("image_processor", {})
        settings["video_processor"] = {"video_processor_type": "Qwen2VLVideoProcessor",
                                       **{key: image[key] for key in ("patch_size", "temporal_patch_size",
                                                                      "merge_size") if key in image}}
        saved.write_text(json.dumps(settings, indent=2))
    os.replace(tmp, out)
    return out


def read_rows(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


# ----------------------------------------------------------------------------------------------------------------------
# What both sides count
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
            world_size: int, extra_flops: float = 0.0) -> dict:
    """Per-GPU throughput of the timed steps from the tokens and attention pairs all ranks processed in them.
    `extra_flops`: FLOPs all ranks spent in the timed steps beyond the language model's (a vision-language model's
    tower and projector), added to both TFLOP/s conventions and MFU."""
    import torch

    from model_utils.models.build import gpu_peak_tflops

    steps = max(len(times), 1)
    per_gpu_step = tokens / world_size / steps
    f12, f6 = flops_per_token(config, num_params, seq_len, area / tokens if tokens else None)
    peak = gpu_peak_tflops(torch.cuda.get_device_name()) if torch.cuda.is_available() else None
    out = {"tokens_per_step_per_gpu": per_gpu_step, "loss_tokens_per_step_per_gpu": loss_tokens / world_size / steps,
           **throughput(per_gpu_step, times, f12, f6, peak)}
    if extra_flops and sum(times) > 0:
        extra = extra_flops / world_size / sum(times) / 1e12
        out.update(extra_tflops_per_gpu=extra, tflops_per_gpu=out["tflops_per_gpu"] + extra,
                   tflops_per_gpu_6=out["tflops_per_gpu_6"] + extra)
        if peak:
            out.update(mfu=out["tflops_per_gpu"] / peak, mfu_6=out["tflops_per_gpu_6"] / peak)
    return out


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
# Our side's run, timed as the trainer's loop runs it
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


def built_run(argv: list[str], check_data: bool = True):
    """(cfg, dist, run, setup seconds): the trainer's run of `argv` as its main() builds it, on this process's rank
    (parse_args -> make_plan -> check_plan -> build_run), without the disk checks: a benchmark never saves.
    `check_data` False leaves the data to the run, as main()'s checked_plan does (the preflight's data check reads
    rows with images as text: vlm_bench.py)."""
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
    raise_on_problems(check_plan(plan, check_data=check_data, check_disk=False))
    run = build_run(plan, dist, log)
    return cfg, dist, run, time.perf_counter() - t0


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


# ----------------------------------------------------------------------------------------------------------------------
# The report
# ----------------------------------------------------------------------------------------------------------------------
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
