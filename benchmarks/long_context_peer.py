"""The long-sequence peer (`long_context.py --peer`): Hugging Face Trainer + DeepSpeed with Ulysses sequence
parallelism through accelerate's `ParallelismConfig(sp_backend="deepspeed")`, configured as transformers' own guide
does (docs/source/en/deepspeed_alst.md: `DeepSpeedSequenceParallelConfig`, `sp_seq_length_is_variable`, its
attention among "sdpa", "flash_attention_2" and "flash_attention_3"), with Liger and activation checkpointing; the
same preset, random-token sequences, micro-batch 1 and DeepSpeed config as the trainer's runs; `--sequence_parallel 1`
is the plain Trainer on each GPU (no ParallelismConfig), `--lora_rank` the adapters our run builds
(models.lora.lora_config), GPU_MEMORY_GIB the allocator held as ours is (a larger GPU standing in for a smaller
one). Started by torchrun, one process per GPU. Each step's record goes to CHECKPOINT_DIR/metrics.jsonl in the
trainer's form (`step`, `loss`, `lr`, `step_time_s`, `tokens_per_s_per_device`, `mfu`, `peak_mem_gib`,
`host_peak_mem_gib`), so long_context.py reads both sides alike. The guide's Trainer has no tiled MLP and no
offloaded checkpoints (ALST's other parts).

    torchrun --nproc_per_node 2 benchmarks/long_context_peer.py --model llama-8b --seq_len 131072 \\
        --sequence_parallel 2 --steps 3 --ds_config configs/zero3.json --checkpoint_dir /tmp/peer -- \\
        --gradient_checkpointing --rope_scaling yarn:2
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from common import host_peak_gib, normalize_env  # noqa: E402
from hf_peer import optimizer_arguments, step_timer, trainer_ds_config  # noqa: E402
from report import base_parameters, flops_per_token  # noqa: E402

GIB = 2**30


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama-1b")
    parser.add_argument("--seq_len", type=int, required=True)
    parser.add_argument("--sequence_parallel", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--ds_config", default="ds_config.json")
    parser.add_argument("--checkpoint_dir", required=True, help="where metrics.jsonl goes")
    parser.add_argument("--attn", default="sdpa", choices=("sdpa", "flash_attention_2", "flash_attention_3"),
                        help="sp_attn_implementation (the guide's choices)")
    parser.add_argument("--gradient_checkpointing", action="store_true")
    parser.add_argument("--rope_scaling", default=None)
    parser.add_argument("--no-liger", dest="liger", action="store_false")
    parser.add_argument("--lora_rank", type=int, default=0, help="LoRA adapters of this rank (ours' defaults "
                        "otherwise)")
    args, ignored = parser.parse_known_args([a for a in sys.argv[1:] if a != "--"])  # the trainer's other flags

    normalize_env()
    import torch
    from accelerate.utils import DeepSpeedSequenceParallelConfig, ParallelismConfig
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from model_utils.data.tokenizer import load_tokenizer
    from model_utils.models.build import build_model, gpu_peak_tflops, model_config
    from model_utils.runtime.distributed import cap_gpu_memory

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    split, seq_len = args.sequence_parallel, args.seq_len
    out = Path(args.checkpoint_dir)
    out.mkdir(parents=True, exist_ok=True)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        cap_gpu_memory(torch.cuda.current_device())

    tokenizer = load_tokenizer(None)
    config = model_config(args.model, tokenizer, rope_scaling=args.rope_scaling)
    raw = json.loads(Path(args.ds_config).read_text())
    parallelism = ParallelismConfig(
        sp_backend="deepspeed", sp_size=split, dp_replicate_size=world // split,
        sp_handler=DeepSpeedSequenceParallelConfig(sp_seq_length_is_variable=True, sp_attn_implementation=args.attn)
    ) if split > 1 else None
    # TrainingArguments first: under ZeRO-3 its DeepSpeed config partitions the model as it is created
    training = TrainingArguments(
        output_dir=str(out / "hf"), per_device_train_batch_size=1, gradient_accumulation_steps=1,
        gradient_checkpointing=args.gradient_checkpointing, max_steps=args.steps, **optimizer_arguments(raw),
        warmup_steps=1, bf16=cuda, deepspeed=trainer_ds_config(raw),
        parallelism_config=parallelism, use_liger_kernel=args.liger, logging_steps=1, save_strategy="no",
        report_to="none", disable_tqdm=True, seed=1234, use_cpu=not cuda)
    model = build_model(args.model, config, torch.float32, args.attn, False)
    if args.lora_rank:  # peft's model, as Trainer takes it; the checkpointed layers' inputs carry gradients to it
        from peft import get_peft_model

        from model_utils.config.settings import LoraSettings
        from model_utils.models.lora import lora_config

        model = get_peft_model(model, lora_config(config, LoraSettings(rank=args.lora_rank)))
        if args.gradient_checkpointing:
            model.enable_input_require_grads()
    if not cuda:  # accelerate starts DeepSpeed's communication on GPUs only; a CPU check runs it on gloo
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")

    class RandomSequences(torch.utils.data.Dataset):  # what one optimizer step costs does not depend on the tokens
        def __len__(self):
            return args.steps * world

        def __getitem__(self, index):
            ids = torch.randint(0, len(tokenizer), (seq_len,), generator=torch.Generator().manual_seed(index))
            # DeepSpeed's Ulysses data loader adapter shards by the positions: it requires them in every batch
            return {"input_ids": ids, "labels": ids.clone(), "position_ids": torch.arange(seq_len)}

    num_params = base_parameters(model)
    flops_12, _ = flops_per_token(config, num_params, seq_len)
    peak = gpu_peak_tflops(torch.cuda.get_device_name()) if cuda else None
    tokens_per_device = seq_len * (world // split) / world  # a step trains one sequence per data-parallel group

    timer = step_timer(0, args.steps, rank)  # each optimizer step timed as hf_peer.py times the HF peer's

    class StepRecords(TrainerCallback):
        """Each step's record, written once Trainer logs its loss (after the timer has taken the step's time)."""

        def on_log(self, a, state, control, logs=None, **kw):
            if rank or not logs or "loss" not in logs or not timer.times:
                return
            seconds = timer.times[-1]
            rate = tokens_per_device / seconds
            record = {"step": state.global_step, "loss": float(logs["loss"]), "lr": float(logs.get("learning_rate", 0)),
                      "step_time_s": seconds, "tokens_per_s_per_device": rate,
                      "mfu": rate * flops_12 / 1e12 / peak if peak else None,
                      "peak_mem_gib": torch.cuda.max_memory_allocated() / GIB if cuda else None,
                      "host_peak_mem_gib": host_peak_gib()}
            with open(out / "metrics.jsonl", "a") as f:
                f.write(json.dumps(record) + "\n")
            print(f"step {record['step']} | loss {record['loss']:.4f} | step {seconds:.3f}s | "
                  f"peak_mem {record['peak_mem_gib'] or 0:.1f}GiB", flush=True)

    if rank == 0:
        print("peer: HF Trainer + DeepSpeed, "
              + (f"Ulysses over {split} GPUs (accelerate ParallelismConfig)" if split > 1 else "no sequence "
                 "parallelism")
              + (f", LoRA rank {args.lora_rank}" if args.lora_rank else "") + ", attention "
              f"{args.attn}, Liger {'on' if args.liger else 'off'}, checkpointing "
              f"{'on' if args.gradient_checkpointing else 'off'}, {num_params / 1e9:.2f}B parameters"
              + (f"; not its flags, left out: {' '.join(ignored)}" if ignored else ""), flush=True)
    Trainer(model=model, args=training, train_dataset=RandomSequences(), callbacks=[timer, StepRecords()]).train()
    timer.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
