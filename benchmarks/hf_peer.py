"""The Hugging Face Trainer peer (`--compare-hf`): HF Trainer + DeepSpeed, with and without Liger, on the same model,
seq len, micro-batch, random blocks and DeepSpeed config as the engine runs, timed the same way (CUDA synchronised
around each step, GPU telemetry over the timed steps) and reported with the same arithmetic."""

from __future__ import annotations

import copy
import json
import os
import time
from pathlib import Path

from common import cuda_sync, ds_config_for, host_peak_gib, normalize_env, peak_memory
from report import base_parameters, flops_per_token, throughput
from telemetry import GpuTelemetry

# Hugging Face Trainer peers (--compare-hf): Liger on/off, and (--hf-fa4) Liger with transformers' own FA4 path.
HF_PEERS = {"noliger": {"liger": False, "attn": "sdpa"}, "liger": {"liger": True, "attn": "sdpa"},
            "liger_fa4": {"liger": True, "attn": "flash_attention_4"}}


def hf_ds_config(job: dict, workdir: Path) -> dict:
    """The job's DeepSpeed config (common.ds_config_for) as HF Trainer takes it (trainer_ds_config)."""
    return trainer_ds_config(json.loads(ds_config_for(job, workdir / "ds_config.json").read_text()))


def trainer_ds_config(raw: dict) -> dict:
    """A copy of a DeepSpeed config with the values HF Trainer fills from TrainingArguments set to "auto": batch
    sizes, accumulation, clipping, bf16, the optimizer's hyperparameters and the scheduler's step counts."""
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


def optimizer_arguments(raw: dict) -> dict:
    """TrainingArguments' optimizer and clipping values from a DeepSpeed config (the values trainer_ds_config leaves
    "auto" for Trainer to fill), so the peer steps with the config's AdamW."""
    params = raw.get("optimizer", {}).get("params", {})
    betas = params.get("betas", [0.9, 0.999])
    clipping = raw.get("gradient_clipping", 1.0)
    return {"learning_rate": params.get("lr", 3e-4), "weight_decay": params.get("weight_decay", 0.0),
            "adam_beta1": betas[0], "adam_beta2": betas[1], "adam_epsilon": params.get("eps", 1e-8),
            "max_grad_norm": 1.0 if clipping == "auto" else clipping}


def step_timer(warmup: int, steps: int, rank: int):
    """A TrainerCallback timing whole optimizer steps (Trainer's on_step_begin fires before a step's first
    micro-batch, on_step_end after its update), CUDA synchronised at both ends as the engine worker times the
    trainer's train_step, with GPU telemetry over the timed steps; it keeps the losses Trainer logs."""
    from transformers import TrainerCallback

    telemetry = GpuTelemetry()

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.times, self.t, self.gpu, self.losses = [], None, {}, []

        def on_step_begin(self, a, state, control, **kw):
            if len(self.times) == warmup and rank == 0:
                telemetry.start()
            cuda_sync()
            self.t = time.perf_counter()

        def on_step_end(self, a, state, control, **kw):
            cuda_sync()
            self.times.append(time.perf_counter() - self.t)
            if len(self.times) == warmup + steps:  # the last timed step: Trainer's wind-down is not sampled
                self.gpu = telemetry.stop()

        def on_log(self, a, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                self.losses.append(float(logs["loss"]))

        def finish(self) -> dict:
            """The telemetry's figures (stopped here if the run ended before its last timed step)."""
            return self.gpu or telemetry.stop()

    return StepTimer()


def worker_hf(job: dict, workdir: Path) -> dict:
    normalize_env()
    from model_utils.runtime.distributed import distributed_env_problems

    assert not distributed_env_problems()  # a single process gets RANK/WORLD_SIZE/MASTER_* like the trainer's
    import numpy as np
    import torch
    from transformers import Trainer, TrainingArguments

    from model_utils.data.pipeline import dummy_packed
    from model_utils.data.tokenizer import load_tokenizer
    from model_utils.models.build import build_model, gpu_peak_tflops, model_config

    steps, warmup, mb = job["steps"], job["warmup"], job["micro_batch_size"]
    accumulation = job.get("gradient_accumulation_steps", 1)
    from model_utils.config.presets import default_seq_len

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
    raw = json.loads((workdir / "ds_config.json").read_text())
    # Trainer's callbacks fire once per optimizer step (on_step_begin before its first micro-batch, on_step_end after
    # the update): the timer times whole steps, as the engine worker times the trainer's train_step.
    args = TrainingArguments(
        output_dir=str(workdir / "hf"), per_device_train_batch_size=mb, gradient_accumulation_steps=accumulation,
        gradient_checkpointing=bool(job.get("gradient_checkpointing")),
        max_steps=steps + warmup, **optimizer_arguments(raw), warmup_steps=1, bf16=cuda, deepspeed=ds,
        use_liger_kernel=bool(job.get("liger")), logging_steps=10**6, save_strategy="no", report_to="none",
        disable_tqdm=True, seed=job.get("seed", 1234), dataloader_num_workers=2 if cuda else 0,
        use_cpu=not cuda)
    model = build_model(job["model"], mconf, torch.float32, job.get("attn", "sdpa"), False)

    rank = int(os.environ.get("RANK", "0"))
    timer = step_timer(warmup, steps, rank)
    trainer = Trainer(model=model, args=args, train_dataset=Blocks(), callbacks=[timer])
    trainer.train()
    gpu = timer.finish()
    world = args.world_size
    num_params = base_parameters(model)
    f12, f6 = flops_per_token(mconf, num_params, seq_len)
    peak = gpu_peak_tflops(torch.cuda.get_device_name()) if cuda else None
    times = timer.times[warmup:]
    result = {"kind": "hf", "liger": bool(job.get("liger")), "attn": job.get("attn", "sdpa"), "world_size": world,
              "num_params": num_params,
              "micro_batch_size": mb, "seq_len": seq_len, "gradient_accumulation_steps": accumulation,
              "gradient_checkpointing": bool(job.get("gradient_checkpointing")),
              "tokens_per_optimizer_step": mb * accumulation * seq_len * world, "timed_steps": len(times),
              **throughput(mb * accumulation * seq_len, times, f12, f6, peak), **peak_memory(), **gpu,
              "host_peak_gib": host_peak_gib()}
    return result if rank == 0 else None
