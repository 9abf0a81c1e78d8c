"""The peers sft_bench.py measures the trainer against (`--peer`), each configured as its own documentation recommends,
on the model, chat rows, block length and tokens per optimizer step ours trains with:

- trl (full, lora, qlora): TRL's SFTTrainer. Full fine-tuning and LoRA with DeepSpeed, Liger and packed padding-free
  rows (its fastest documented path; `--peer-packing` runs its padded path). QLoRA as TRL's PEFT guide trains on one
  GPU: `SFTTrainer(model=PATH, quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
  bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=bfloat16), peft_config=LoraConfig(...))`, no DeepSpeed.
- unsloth (lora, qlora): `FastLanguageModel.from_pretrained(model_name=PATH, max_seq_length=, load_in_4bit=)` and
  `FastLanguageModel.get_peft_model(model, r=, lora_alpha=, lora_dropout=, bias="none", target_modules=<the seven
  linear layers>, use_gradient_checkpointing="unsloth", random_state=3407)`, then TRL's SFTTrainer as Unsloth's
  notebooks run it (`optim="adamw_8bit"`, `lr_scheduler_type="linear"`) on packed padding-free rows (`packing=True`,
  Unsloth's advice for speed).
- axolotl (full, lora): a YAML config as axolotl's examples write it (`sample_packing: true`, `flash_attention: true`,
  the Liger plugin with its kernels, `deepspeed:` the same ZeRO config as ours, `adapter: lora` with
  `lora_target_linear: true`), trained by `axolotl.cli.train.do_train`; axolotl_timing.py's plugin adds the timer.

Unsloth and axolotl pin other releases of transformers, TRL and datasets than the trainer's: each runs from its own
`pip install --target DIR` folder, which `--peer-env DIR` puts first on the worker's PYTHONPATH. Every peer trains with
our plan's learning rate, betas, epsilon, weight decay, clipping, warm-up and LoRA rank, alpha, dropout and targets, so
the losses compare; the optimizer is each peer's recommended one. `peer_settings` gives what a peer is handed
(`sft_bench.py --print-config` prints it without a GPU or the peer); the workers hand it over, time whole optimizer
steps (hf_peer.step_timer) and count the example tokens of each micro-batch as ours are counted (fine_tuning_work). Each result
records the kernels the peer ran (attention, Liger or its own) and the peer's versions.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from common import host_peak_gib, normalize_env, peak_memory
from report import base_parameters
from fine_tuning_work import (IGNORE_INDEX, all_ranks_max, all_ranks_sum, figures, liger_applied,
                              peer_example_lengths, read_rows, trainer_argv, work_of)

PEERS = {"trl": "TRL SFTTrainer", "unsloth": "Unsloth", "axolotl": "axolotl"}
PEER_MODES = {"trl": ("full", "lora", "qlora"), "unsloth": ("lora", "qlora"), "axolotl": ("full", "lora")}
UNSLOTH_SEED = 3407  # the random_state of Unsloth's notebooks
LIGER_KERNELS = ("liger_rope", "liger_rms_norm", "liger_glu_activation", "liger_fused_linear_cross_entropy")


# ----------------------------------------------------------------------------------------------------------------------
# What each peer is handed
# ----------------------------------------------------------------------------------------------------------------------
def our_plan(job: dict, workdir: Path, on_gpus: bool, argv_of=trainer_argv):
    """(our config, our plan) for the job's flags (`argv_of(job, workdir)`): the optimisation, LoRA settings and
    tokenizer the peer trains with (our micro-batch 1 where the peer's micro-batches count padded examples, which as
    our blocks might not fit)."""
    from model_utils.config.flags import parse_args
    from model_utils.planning.plan import make_plan

    packed = job.get("peer_packing", "bfd") == "bfd"
    cfg = parse_args(argv_of(job if packed else dict(job, micro_batch_size=1), workdir))
    return cfg, make_plan(cfg, int(os.environ.get("WORLD_SIZE", "1")), on_training_hardware=on_gpus, decides=False)


def training_arguments(job: dict, plan, accumulation: int, cuda: bool) -> dict:
    """The Trainer arguments every peer shares with ours: batch, length, steps, and our plan's optimisation."""
    ds = plan.ds_config
    opt = ds.get("optimizer", {}).get("params", {})
    betas = opt.get("betas", [0.9, 0.999])
    return {"per_device_train_batch_size": job["micro_batch_size"], "gradient_accumulation_steps": accumulation,
            "max_steps": job["steps"] + job["warmup"], "learning_rate": opt.get("lr", 3e-4),
            "weight_decay": opt.get("weight_decay", 0.0), "adam_beta1": betas[0], "adam_beta2": betas[1],
            "adam_epsilon": opt.get("eps", 1e-8), "max_grad_norm": ds.get("gradient_clipping", 1.0),
            "warmup_steps": ds.get("scheduler", {}).get("params", {}).get("warmup_num_steps", 0),
            "seed": job["seed"], "bf16": cuda, "logging_steps": 1, "save_strategy": "no", "report_to": "none"}


def lora_arguments(cfg, plan) -> dict:
    """Our LoRA settings as peft's LoraConfig names them (models.lora.lora_config: the targets ours adapts)."""
    from model_utils.models.lora import lora_config

    lora = lora_config(plan.model.config, cfg.model.lora_settings())
    return {"r": lora.r, "lora_alpha": lora.lora_alpha, "lora_dropout": lora.lora_dropout,
            "target_modules": sorted(lora.target_modules) if not isinstance(lora.target_modules, str)
            else lora.target_modules, "bias": "none"}


def bnb_4bit(cuda: bool) -> dict:
    """The BitsAndBytesConfig of TRL's and peft's QLoRA guides: NF4, double quantization, bf16 compute (fp32 on CPU)."""
    return {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True,
            "bnb_4bit_compute_dtype": "bfloat16" if cuda else "float32"}


def peer_settings(peer: str, job: dict, cfg, plan, accumulation: int, cuda: bool, workdir: Path) -> dict:
    """What `peer` is handed for `job` (JSON: dtypes by name), as its documentation recommends."""
    from hf_peer import trainer_ds_config

    mode, seq_len = job["mode"], job["seq_len"]
    training = training_arguments(job, plan, accumulation, cuda)
    adapters = lora_arguments(cfg, plan) if mode != "full" else None
    checkpointing = bool(job.get("gradient_checkpointing"))
    if peer == "trl":
        packing = job.get("peer_packing", "bfd")
        qlora = mode == "qlora"
        sft = {**training, "max_length": seq_len, "assistant_only_loss": True, "packing": packing == "bfd",
               "padding_free": packing == "bfd", "use_liger_kernel": bool(job.get("peer_liger")) and cuda,
               "gradient_checkpointing": checkpointing, "gradient_checkpointing_kwargs": {"use_reentrant": False},
               "deepspeed": None if qlora else trainer_ds_config(plan.ds_config), "use_cpu": not cuda,
               "dataloader_num_workers": 2 if cuda else 0, "logging_nan_inf_filter": False, "disable_tqdm": True,
               **({"packing_strategy": "bfd"} if packing == "bfd" else {}),
               **({"train_sampling_strategy": "group_by_length"} if packing == "grouped" else {}),
               **({"model_init_kwargs": {"dtype": "bfloat16" if cuda else "float32",
                                         "attn_implementation": job.get("peer_attn", "sdpa")}} if qlora else {})}
        return {"sft_config": sft, "quantization_config": bnb_4bit(cuda) if qlora else None, "peft_config": adapters}
    if peer == "unsloth":
        sft = {**training, "max_length": seq_len, "assistant_only_loss": True, "packing": True,
               "optim": "adamw_8bit", "lr_scheduler_type": "linear", "dataset_num_proc": 2}
        peft = {**adapters, "use_gradient_checkpointing": "unsloth", "random_state": UNSLOTH_SEED,
                "use_rslora": False, "loftq_config": None}
        return {"from_pretrained": {"model_name": job["model"], "max_seq_length": seq_len, "dtype": None,
                                    "load_in_4bit": mode == "qlora", "full_finetuning": False},
                "get_peft_model": peft, "sft_config": sft}
    if peer == "axolotl":
        return {"config": axolotl_config(job, training, adapters, plan, workdir)}
    raise ValueError(f"unknown peer {peer!r}")


def axolotl_config(job: dict, training: dict, adapters: dict | None, plan, workdir: Path) -> dict:
    """axolotl's YAML config as its examples write it: packed samples, FlashAttention, Liger's kernels through its
    plugin, DeepSpeed with our ZeRO config, the chats by the tokenizer's template with the loss on the answers."""
    from hf_peer import trainer_ds_config

    ds_path = workdir / "axolotl-deepspeed.json"
    ds_path.write_text(json.dumps(trainer_ds_config(plan.ds_config), indent=2))
    config = {
        "base_model": job["model"], "chat_template": "tokenizer_default",
        "datasets": [{"path": job["rows"], "ds_type": "json", "type": "chat_template", "field_messages": "messages",
                      "roles_to_train": ["assistant"]}],
        "dataset_prepared_path": str(workdir / "axolotl-prepared"), "val_set_size": 0.0,
        "output_dir": str(workdir / "axolotl-out"), "sequence_len": job["seq_len"], "sample_packing": True,
        "eval_sample_packing": False, "pad_to_sequence_len": True, "flash_attention": True,
        "micro_batch_size": training["per_device_train_batch_size"],
        "gradient_accumulation_steps": training["gradient_accumulation_steps"], "max_steps": training["max_steps"],
        "num_epochs": 1, "optimizer": "adamw_torch_fused", "lr_scheduler": "cosine",
        "learning_rate": training["learning_rate"], "weight_decay": training["weight_decay"],
        "adam_beta1": training["adam_beta1"], "adam_beta2": training["adam_beta2"],
        "adam_epsilon": training["adam_epsilon"], "max_grad_norm": training["max_grad_norm"],
        "warmup_steps": training["warmup_steps"], "seed": training["seed"], "bf16": "auto", "tf32": True,
        "gradient_checkpointing": bool(job.get("gradient_checkpointing")), "logging_steps": 1, "save_strategy": "no",
        "deepspeed": str(ds_path), "plugins": ["axolotl.integrations.liger.LigerPlugin", "axolotl_timing.StepTiming"],
        **{kernel: True for kernel in LIGER_KERNELS}}
    if adapters is not None:
        config.update(adapter="lora", lora_r=adapters["r"], lora_alpha=round(adapters["lora_alpha"]),  # an int there
                      lora_dropout=adapters["lora_dropout"], lora_target_linear=True)
    return config


def run_in_environment(job: dict, peer_env: str | None, run):
    """`run()` with `peer_env` first on PYTHONPATH (a peer's own `pip install --target` folder), or as it is."""
    if not peer_env:
        return run()
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(peer_env).resolve()), saved]))
    try:
        return run()
    finally:
        if saved is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = saved


def print_peer_config(a, jobs: list[dict], workdir: Path, global_tokens: int) -> int:
    """sft_bench.py --print-config: per mode and micro-batch of the peer's `jobs`, what the peer is handed
    (peer_settings) on GPUs, with our plan's optimisation (planned as for GPU nodes: no model or rows are written,
    nothing runs)."""
    from model_utils.config.presets import is_preset

    printed, plans = {}, {}
    for job in (job for job in jobs if job["side"] == "trl"):
        if job["mode"] not in plans:  # the optimisation and adapters of a mode: the same at every micro-batch
            plans[job["mode"]] = our_plan(job, workdir, on_gpus=False)
        cfg, plan = plans[job["mode"]]
        accumulation = global_tokens // (job["micro_batch_size"] * a.nproc * a.seq_len)
        printed[job["name"]] = peer_settings(a.peer, job, cfg, plan, accumulation, True, workdir)
    if is_preset(a.model):  # the run writes the preset as a model directory: a pretrained model to the plan
        printed["note"] = (f"planned with the preset {a.model}; a run writes it as a model directory, which takes the "
                           "fine-tuning defaults (learning rate, warm-up, weight decay: docs/FINE-TUNING.md)")
    print(json.dumps(printed, indent=2, default=str))
    return 0


# ----------------------------------------------------------------------------------------------------------------------
# Counting and the result, alike for every peer
# ----------------------------------------------------------------------------------------------------------------------
class MicroBatchCounter:
    """A forward pre-hook keeping what each timed training forward takes in (its tokens, position ids, loss tokens,
    padded rows' lengths) without waiting for the GPU; `totals` counts them after the run."""

    def __init__(self, timer, warmup: int):
        self.timer, self.warmup, self.timed = timer, warmup, []

    def __call__(self, module, positional, kwargs):
        if module.training and len(self.timer.times) >= self.warmup:
            ids = kwargs.get("input_ids", positional[0] if positional else None)
            labels = kwargs.get("labels")
            loss_tokens = (labels[..., 1:] != IGNORE_INDEX).sum() if labels is not None else None
            mask = kwargs.get("attention_mask")  # padded rows (no packing): each row's example tokens
            rows_lengths = mask.sum(-1) if mask is not None and mask.dim() == 2 else None
            self.timed.append((ids.numel(), kwargs.get("position_ids"), loss_tokens, rows_lengths))

    def totals(self, packing: str) -> tuple[int, int, int]:
        tokens = area = loss_tokens = 0
        for numel, positions, labelled, rows_lengths in self.timed:
            t, a = work_of(peer_example_lengths(packing, numel, positions, rows_lengths))
            tokens, area = tokens + t, area + a
            loss_tokens += int(labelled.item()) if labelled is not None else 0
        return tokens, area, loss_tokens


def peer_versions(*names: str) -> dict:
    from importlib import metadata

    found = {}
    for name in ("torch", "transformers", "trl", "peft", "datasets", "bitsandbytes", "liger-kernel", *names):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def peer_result(job: dict, trainer, timer, counter: MicroBatchCounter, config, accumulation: int, packing: str,
                kernels: dict, versions: dict, num_params: int | None = None, extra_flops: float = 0.0) -> dict:
    """A peer's result in sft_bench's form (rank 0 reports it), from its trainer, timer and counted micro-batches.
    `num_params`: the parameters the FLOPs count (default: the model's less the adapters); `extra_flops`: FLOPs of
    the timed steps beyond those, all ranks' (fine_tuning_work.figures)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    gpu = timer.finish()
    device = trainer.args.device
    tokens, area, loss_tokens = all_ranks_sum(list(counter.totals(packing)), device)
    times = timer.times[job["warmup"]:]
    num_params = base_parameters(trainer.model) if num_params is None else num_params
    data_loss_tokens = loss_tokens_of(trainer.train_dataset)
    out = {"side": "trl", "peer": job.get("peer", "trl"), "data_loss_tokens": data_loss_tokens,
           "mode": job["mode"], "world_size": world, "losses": timer.losses,
           "micro_batch_size": job["micro_batch_size"], "gradient_accumulation_steps": accumulation,
           "seq_len": job["seq_len"], "blocks_per_step": job["micro_batch_size"] * accumulation * world,
           "num_params": num_params, "timed_steps": len(times),
           "packing": packing,  # bfd: blocks_per_step counts bins; none, grouped: examples
           **kernels, "peer_versions": versions,
           **figures(config, num_params, job["seq_len"], int(tokens), int(area), int(loss_tokens), times, world,
                     extra_flops),
           **peak_memory(), **gpu}
    if "peak_mem_gib" in out:
        out["peak_mem_gib"] = all_ranks_max(out["peak_mem_gib"], device)
    out["host_peak_gib"] = all_ranks_max(host_peak_gib(), device)
    return out if int(os.environ.get("RANK", "0")) == 0 else None


def loss_tokens_of(dataset) -> int | None:
    """The tokens carrying loss in a peer's tokenized data: its labels', else its assistant masks' (None: neither)."""
    if "labels" in dataset.column_names:
        return int(sum(sum(label != IGNORE_INDEX for label in labels) for labels in dataset["labels"]))
    if "assistant_masks" in dataset.column_names:
        return int(sum(sum(mask) for mask in dataset["assistant_masks"]))
    return None


def chat_rows(job: dict):
    import datasets

    return datasets.Dataset.from_list([{"messages": row["messages"]} for row in read_rows(job["rows"])])


def dtype_of(name):
    import torch

    return getattr(torch, name) if isinstance(name, str) else name


# ----------------------------------------------------------------------------------------------------------------------
# Workers (one process per GPU; rank 0 writes the result)
# ----------------------------------------------------------------------------------------------------------------------
def worker_trl(job: dict, workdir: Path) -> dict | None:
    normalize_env()
    from model_utils.runtime.distributed import distributed_env_problems

    assert not distributed_env_problems()
    import torch
    from hf_peer import step_timer
    from peft import LoraConfig
    from transformers import BitsAndBytesConfig
    from trl import SFTConfig, SFTTrainer

    from model_utils.data.sft.formats import resolve_chat_template
    from model_utils.models.build import build_model

    cuda = torch.cuda.is_available()
    packing = job.get("peer_packing", "bfd")
    cfg, plan = our_plan(job, workdir, on_gpus=True)
    tokenizer = plan.tokenizer
    tokenizer.chat_template, _ = resolve_chat_template(tokenizer)  # the template ours renders chats with
    rows = chat_rows(job)
    accumulation = peer_accumulation(job, tokenizer, rows)
    settings = peer_settings("trl", job, cfg, plan, accumulation, cuda, workdir)
    sft = dict(settings["sft_config"])
    if "model_init_kwargs" in sft:
        sft["model_init_kwargs"] = {**sft["model_init_kwargs"], "dtype": dtype_of(sft["model_init_kwargs"]["dtype"])}
    args = SFTConfig(output_dir=str(workdir / "trl"), **sft)
    quantization = settings["quantization_config"]
    if quantization:  # QLoRA: TRL loads the model from its path with the quantization config
        model = job["model"]
        quantization = BitsAndBytesConfig(**{**quantization, "bnb_4bit_compute_dtype": dtype_of(
            quantization["bnb_4bit_compute_dtype"])})
    else:
        model = build_model(job["model"], plan.model.config, torch.float32, job.get("peer_attn", "sdpa"), False)
    timer = step_timer(job["warmup"], job["steps"], int(os.environ.get("RANK", "0")))
    peft = settings["peft_config"]
    trainer = SFTTrainer(model=model, args=args, train_dataset=rows, processing_class=tokenizer,
                         quantization_config=quantization, peft_config=LoraConfig(task_type="CAUSAL_LM", **peft)
                         if peft else None, callbacks=[timer])
    counter = MicroBatchCounter(timer, job["warmup"])
    trainer.model.register_forward_pre_hook(counter, with_kwargs=True)
    trainer.train()
    kernels = {"liger": args.use_liger_kernel and liger_applied(trainer.model),  # as Trainer left the model
               "attention": getattr(trainer.model.config, "_attn_implementation", job.get("peer_attn", "sdpa")),
               "base": "4-bit NF4 (bitsandbytes)" if quantization else "16-bit",
               "deepspeed": bool(args.deepspeed)}
    return peer_result(job, trainer, timer, counter, plan.model.config, accumulation, packing, kernels,
                       peer_versions())


def worker_unsloth(job: dict, workdir: Path) -> dict | None:
    import unsloth  # first, as Unsloth's docs say: it patches transformers, TRL and peft as it is imported
    from unsloth import FastLanguageModel

    normalize_env()
    import torch
    from hf_peer import step_timer
    from trl import SFTConfig, SFTTrainer

    from model_utils.data.sft.formats import resolve_chat_template

    cuda = torch.cuda.is_available()
    cfg, plan = our_plan(job, workdir, on_gpus=True)
    rows = chat_rows(job)
    settings = peer_settings("unsloth", job, cfg, plan, peer_accumulation(job, plan.tokenizer, rows), cuda, workdir)
    model, tokenizer = FastLanguageModel.from_pretrained(**settings["from_pretrained"])
    tokenizer.chat_template, _ = resolve_chat_template(tokenizer)  # ours, with its assistant marks
    model = FastLanguageModel.get_peft_model(model, **settings["get_peft_model"])
    sft = settings["sft_config"]
    timer = step_timer(job["warmup"], job["steps"], int(os.environ.get("RANK", "0")))
    trainer = SFTTrainer(model=model, processing_class=tokenizer, train_dataset=rows,
                         args=SFTConfig(output_dir=str(workdir / "unsloth"), **sft), callbacks=[timer])
    counter = MicroBatchCounter(timer, job["warmup"])
    trainer.model.register_forward_pre_hook(counter, with_kwargs=True)
    trainer.train()
    from unsloth.models import _utils

    kernels = {"liger": False, "attention": getattr(model.config, "_attn_implementation", None),
               "unsloth_kernels": "Unsloth's Triton RoPE, RMSNorm, SwiGLU, LoRA MLP/QKV/O and fused cross-entropy",
               "flash_attention": bool(getattr(_utils, "HAS_FLASH_ATTENTION", False)),
               "gradient_checkpointing": "unsloth",
               "base": "4-bit NF4 (bitsandbytes)" if job["mode"] == "qlora" else "16-bit",
               "unsloth": getattr(unsloth, "__version__", None)}
    return peer_result(job, trainer, timer, counter, plan.model.config, sft["gradient_accumulation_steps"], "bfd",
                       kernels, peer_versions("unsloth", "unsloth_zoo", "xformers", "flash-attn"))


def worker_axolotl(job: dict, workdir: Path) -> dict | None:
    normalize_env()
    import axolotl_timing
    import torch
    import yaml
    from axolotl.cli.args import TrainerCliArgs
    from axolotl.cli.config import load_cfg
    from axolotl.cli.train import do_train
    from hf_peer import step_timer

    cuda = torch.cuda.is_available()
    cfg, plan = our_plan(job, workdir, on_gpus=True)
    accumulation = job["global_batch_tokens"] // (job["micro_batch_size"] * job["seq_len"]
                                                  * int(os.environ.get("WORLD_SIZE", "1")))
    config = peer_settings("axolotl", job, cfg, plan, accumulation, cuda, workdir)["config"]
    path = workdir / "axolotl.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    timer = step_timer(job["warmup"], job["steps"], int(os.environ.get("RANK", "0")))
    counter = MicroBatchCounter(timer, job["warmup"])
    axolotl_timing.ATTACH.update(timer=timer, counter=counter)
    do_train(load_cfg(str(path)), TrainerCliArgs())
    trainer = axolotl_timing.ATTACH["trainer"]
    kernels = {"liger": liger_applied(trainer.model), "sample_packing": True,
               "attention": getattr(trainer.model.config, "_attn_implementation", None),
               "deepspeed": bool(trainer.args.deepspeed), "base": "16-bit"}
    return peer_result(job, trainer, timer, counter, plan.model.config, accumulation, "bfd", kernels,
                       peer_versions("axolotl", "flash-attn", "deepspeed"))


WORKERS = {"trl": worker_trl, "unsloth": worker_unsloth, "axolotl": worker_axolotl}


# ----------------------------------------------------------------------------------------------------------------------
# The peer's micro-batches per optimizer step
# ----------------------------------------------------------------------------------------------------------------------
def peer_accumulation(job: dict, tokenizer, rows) -> int:
    """Micro-batches per optimizer step: of packed bins of seq_len, the job's global batch over them; of padded
    examples (TRL's --peer-packing none, grouped), as many examples per step as ours packs into its blocks."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if job.get("peer_packing", "bfd") == "bfd" or job.get("peer") != "trl":
        return job["global_batch_tokens"] // (job["micro_batch_size"] * world * job["seq_len"])
    return examples_accumulation(job["global_batch_tokens"], mean_example_tokens(tokenizer, rows, job["seq_len"]),
                                 job["micro_batch_size"] * world)


def mean_example_tokens(tokenizer, rows, seq_len: int) -> float:
    """The examples' mean length in tokens as the chat template renders them, each cut at seq_len as TRL cuts it."""
    lengths = [min(len(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)), seq_len)
               for messages in rows["messages"]]
    return sum(lengths) / max(len(lengths), 1)


def examples_accumulation(global_tokens: int, mean_tokens: float, examples_per_micro_batch: int) -> int:
    """Micro-batches of padded examples per optimizer step: about global_tokens / mean_tokens examples, as many as
    the other side's blocks hold."""
    return max(1, round(global_tokens / mean_tokens / examples_per_micro_batch))
