"""The peer vlm_bench.py measures the trainer's vision-language fine-tuning against: TRL's SFTTrainer for
vision-language models, as TRL's documentation runs it, on the model directory, rows, optimizer settings, frozen parts
and adapters ours trains with; and what both workers share (our flags, the figures of images and padding).

TRL's path for a dataset with an `images` column (TRL 1.16, `SFTTrainer.__init__`): the rows stay untokenized and its
DataCollatorForVisionLanguageModeling renders, tokenizes and processes the images of each micro-batch on the fly,
padding its rows to the longest (right). What it allows and refuses for such a dataset:

- `packing=True`: refused ("Packing is not supported for vision datasets. Please set `packing=False` in the
  SFTConfig.");
- `padding_free=True`: refused ("Padding-free training is yet not supported for vision datasets. Please set
  `padding_free=False` in the `SFTConfig`.");
- `assistant_only_loss=True`: taken with transformers 5.18 or later (the processor's assistant masks), refused below
  ("Assistant-only loss for vision datasets requires transformers>=5.18.0. Please upgrade transformers or set
  `assistant_only_loss=False` in the `SFTConfig`."); the worker asks for it and, where refused, trains on every token
  (its collator's labels: the input ids, image tokens included, padding masked) and records the refusal;
- `max_length`: None, as its docs advise for vision-language models (a cut inside an image's tokens breaks the step;
  with a length, truncation_mode="keep_end" is refused);
- `use_liger_kernel=True`: Liger's layer kernels (RMSNorm, SwiGLU, RoPE) where liger-kernel knows the model type
  (qwen2_5_vl among them); TRL turns Liger's fused linear cross-entropy off and computes the loss with its own chunked
  LM head (`fused_lm_head`).

The worker hands it: `AutoModelForImageTextToText.from_pretrained(DIR)` (fp32 weights: DeepSpeed's bf16 casts them,
as for ours) with `attn_implementation` flash_attention_2 where FlashAttention 2 is importable, else sdpa (or
--peer-attn), the vision tower frozen as ours freezes it (models.vision.parts.freeze), for LoRA
`peft_config=models.lora.lora_config(...)` of our plan (the adapters on the language model only, a trained projector
saved whole), the processor of DIR (AutoProcessor; where it cannot be built here, data.vision.processor.load_processor,
said in the log) with the image pixel bounds ours resizes to, and SFTConfig with our plan's optimisation, DeepSpeed
config and gradient checkpointing.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from common import normalize_env
from fine_tuning_work import all_ranks_sum, liger_applied, run_flags
from sft_peers import MicroBatchCounter, our_plan, peer_result, peer_versions, training_arguments

ASSISTANT_ONLY_REFUSAL = "Assistant-only loss for vision datasets"  # the start of TRL's refusal below 5.18


def vlm_argv(job: dict, workdir: Path) -> list[str]:
    """Our trainer's flags for a job: the model directory, the rows (relative image paths from the file's folder),
    the parts frozen and the pixel bound of an image, then the flags every benchmark run takes (run_flags)."""
    argv = ["--model", job["model"], "--dataset", job["rows"], "--freeze", job["freeze"]]
    if job.get("max_image_pixels"):
        argv += ["--max_image_pixels", str(job["max_image_pixels"])]
    return argv + run_flags(job, workdir)


def vision_fields(positions: float, tokens: float, images: float, image_tokens: float, steps: int,
                  world: int) -> dict:
    """What both sides report of their timed micro-batches beside the throughput: the share of their positions that
    is padding, the images and image tokens per step and GPU."""
    steps = max(steps, 1)
    return {"padding_share": 1 - tokens / positions if positions else 0.0,
            "positions_per_step_per_gpu": positions / world / steps, "images_per_step_per_gpu": images / world / steps,
            "image_tokens_per_step_per_gpu": image_tokens / world / steps}


class VisionCounter(MicroBatchCounter):
    """MicroBatchCounter keeping also each timed micro-batch's images (their patch grids) and image tokens, as
    tensors: read after the run, nothing waits on the GPU during it."""

    def __init__(self, timer, warmup: int, image_token_id: int):
        super().__init__(timer, warmup)
        self.image_token_id, self.images = image_token_id, []

    def __call__(self, module, positional, kwargs):
        counted = len(self.timed)
        super().__call__(module, positional, kwargs)
        if len(self.timed) > counted:
            ids = kwargs.get("input_ids", positional[0] if positional else None)
            self.images.append((kwargs.get("image_grid_thw"), (ids == self.image_token_id).sum()))

    def vision_totals(self, flops) -> tuple[int, int, int, float]:
        """(positions, images, image tokens, the tower's and projector's FLOPs by `flops`: VisionFlops) of the timed
        micro-batches."""
        positions = sum(numel for numel, *_ in self.timed)
        images = image_tokens = 0
        total = 0.0
        for grid, tokens in self.images:
            patches = [int(p) for p in grid.prod(-1).tolist()] if grid is not None else []
            images, image_tokens = images + len(patches), image_tokens + int(tokens)
            total += flops.flops(patches, int(tokens)) if patches else 0.0
        return positions, images, image_tokens, total


def image_tokens_of(processor, rows_file: Path) -> list[list[int]]:
    """Each row's images' tokens by `processor`'s pixel bounds (data.vision.encode.ImageTokens on a blank image of
    each size, once per size): what both sides' images become."""
    from PIL import Image

    from model_utils.data.vision.encode import ImageTokens

    expand, by_size, out = ImageTokens(processor), {}, []
    with open(rows_file, encoding="utf-8") as f:
        for row in (json.loads(line) for line in f if line.strip()):
            counts = []
            for image in row.get("images") or []:
                with Image.open(Path(rows_file).parent / image) as opened:
                    size = opened.size
                if size not in by_size:
                    by_size[size] = len(expand.expand(Image.new("RGB", size))[0])
                counts.append(by_size[size])
            out.append(counts)
    return out


def peer_processor(path: str) -> tuple[object, str]:
    """(DIR's processor, how it was built): transformers' AutoProcessor, or where it cannot build it here (the
    Qwen-VL family's video processor needs torchvision) data.vision.processor.load_processor's image-only one."""
    from transformers import AutoConfig, AutoProcessor

    try:
        return AutoProcessor.from_pretrained(path), "AutoProcessor"
    except ImportError as e:
        from model_utils.data.vision.processor import load_processor

        reason = str(e).strip().splitlines()[0].split(". ")[0]
        print(f"TRL side: AutoProcessor cannot build the processor of {path} here ({reason}); built by "
              "data.vision.processor.load_processor instead (its image processor and tokenizer, no video processor)",
              flush=True)
        return load_processor(path, AutoConfig.from_pretrained(path).model_type), f"load_processor ({reason})"


def peer_attention(requested: str) -> tuple[str, str]:
    """(attn_implementation, why): --peer-attn auto takes FlashAttention 2 where it is importable (TRL's and
    transformers' recommendation for padded vision-language batches), else PyTorch's SDPA."""
    if requested != "auto":
        return requested, "--peer-attn"
    from transformers.utils import is_flash_attn_2_available

    if is_flash_attn_2_available():
        return "flash_attention_2", "flash_attn (FlashAttention 2) importable"
    return "sdpa", "flash_attn (FlashAttention 2) not importable here"


def liger_support(model_type: str, cuda: bool, requested: bool) -> tuple[bool, str]:
    """(use_liger_kernel, why): on CUDA, where liger-kernel is installed and knows the model type."""
    if not requested:
        return False, "--peer-liger off"
    if not cuda:
        return False, "no CUDA (Liger's kernels are Triton's)"
    try:
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
    except ImportError as e:
        return False, f"liger-kernel not importable ({e})"
    if model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:
        return False, f"liger-kernel has no kernels for model type {model_type}"
    return True, f"liger-kernel knows {model_type}"


def vision_rows(path: str):
    """The rows as TRL's vision datasets hold them: `messages`, and `images` decoded to PIL images on access (a
    `datasets` Image feature) from the files the rows name relative to their JSONL file."""
    import datasets

    base = Path(path).parent
    with open(path, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    table = datasets.Dataset.from_list([{"messages": row["messages"],
                                         "images": [str(base / image) for image in row.get("images") or []]}
                                        for row in rows])
    return table.cast_column("images", datasets.Sequence(datasets.Image()))


def trl_trainer(model, sft: dict, output_dir: str, rows, processor, peft, timer):
    """(SFTTrainer, TRL's refusal of assistant_only_loss or None): built with assistant_only_loss, and where TRL
    refuses it for vision datasets (transformers before 5.18), without."""
    from trl import SFTConfig, SFTTrainer

    def build(assistant_only: bool):
        return SFTTrainer(model=model, args=SFTConfig(output_dir=output_dir, **sft, assistant_only_loss=assistant_only),
                          train_dataset=rows, processing_class=processor, peft_config=peft, callbacks=[timer])

    try:
        return build(True), None
    except ValueError as e:
        if ASSISTANT_ONLY_REFUSAL not in str(e):
            raise
        print(f"TRL side: {e} -> assistant_only_loss=False (the loss on every token)", flush=True)
        return build(False), str(e)


def worker_trl(job: dict, workdir: Path) -> dict | None:
    normalize_env()
    from model_utils.runtime.distributed import distributed_env_problems

    assert not distributed_env_problems()
    import torch
    from hf_peer import step_timer, trainer_ds_config
    from transformers import AutoModelForImageTextToText

    from model_utils.data.vision.processor import image_token, set_image_pixels
    from model_utils.models.lora import lora_config
    from model_utils.models.vision.parts import freeze

    cuda = torch.cuda.is_available()
    _, plan = our_plan(dict(job, peer_packing="none"), workdir, on_gpus=True, argv_of=vlm_argv)
    vision, accumulation = plan.model.vision, job["peer_accumulation"]
    processor, processor_source = peer_processor(job["model"])
    if job.get("max_image_pixels"):
        set_image_pixels(processor, job["max_image_pixels"], None)  # the bound ours resizes images within
    attention, attention_why = peer_attention(job.get("peer_attn", "auto"))
    model = AutoModelForImageTextToText.from_pretrained(job["model"], dtype=torch.float32,
                                                        attn_implementation=attention)
    freeze(model, vision.frozen)
    liger, liger_why = liger_support(model.config.model_type, cuda, bool(job.get("peer_liger")))
    checkpointing = bool(job.get("gradient_checkpointing"))
    sft = {**training_arguments(job, plan, accumulation, cuda), "max_length": None, "packing": False,
           "padding_free": False, "use_liger_kernel": liger, "gradient_checkpointing": checkpointing,
           "gradient_checkpointing_kwargs": {"use_reentrant": False}, "deepspeed": trainer_ds_config(plan.ds_config),
           "use_cpu": not cuda, "dataloader_num_workers": 4 if cuda else 0, "logging_nan_inf_filter": False,
           "disable_tqdm": True}
    peft = lora_config(model.config, plan.model.lora, model) if job["mode"] == "lora" else None
    timer = step_timer(job["warmup"], job["steps"], int(os.environ.get("RANK", "0")))
    trainer, refusal = trl_trainer(model, sft, str(workdir / "trl"), vision_rows(job["rows"]), processor, peft, timer)
    counter = VisionCounter(timer, job["warmup"], image_token(processor)[1])
    trainer.model.register_forward_pre_hook(counter, with_kwargs=True)
    trainer.train()
    positions, images, image_tokens, flops = all_ranks_sum(list(counter.vision_totals(vision.flops)),
                                                           trainer.args.device)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    kernels = {"liger": liger and liger_applied(trainer.model), "liger_why": liger_why,
               "attention": getattr(trainer.model.config, "_attn_implementation", attention),
               "attention_why": attention_why, "deepspeed": bool(trainer.args.deepspeed),
               "processor": processor_source, "assistant_only_loss": refusal is None,
               "assistant_only_loss_refused": refusal, "dataloader_num_workers": sft["dataloader_num_workers"]}
    out = peer_result(job, trainer, timer, counter, vision.config.get_text_config(), accumulation, "none", kernels,
                      peer_versions("torchvision", "flash-attn"), num_params=vision.part_params["language_model"],
                      extra_flops=flops)
    if out is not None:
        tokens = out["tokens_per_step_per_gpu"] * world * out["timed_steps"]
        out.update(vision_fields(positions, tokens, images, image_tokens, out["timed_steps"], world),
                   examples_per_step=job["micro_batch_size"] * accumulation * world,
                   data_image_tokens=sum(map(sum, image_tokens_of(processor, Path(job["rows"])))))
    return out
