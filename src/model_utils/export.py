"""Export any checkpoint of this project to a Hugging Face model directory, on CPU, without GPUs.

    python -m model_utils.export checkpoints                      # the newest complete checkpoint -> checkpoints/hf
    python -m model_utils.export checkpoints/step-00001000 --output /models/run1 --dtype bfloat16
    python -m model_utils.export checkpoints --merged             # a LoRA run: hf/adapter and hf/merged

Works for ZeRO stages 1, 2 and 3, offloaded or not: DeepSpeed's `zero_to_fp32` merges the fp32 master weights from
every rank's optimizer shards (never the possibly-empty 16-bit ZeRO-3 module weights). The model is built on the meta
device and takes those tensors as its parameters (`assign=True`), so only one full copy is ever in memory. A LoRA
checkpoint holds the adapters only: they are loaded into the pretrained model its manifest names, wrapped again with
the manifest's LoRA settings (lora.export_lora_checkpoint).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from .checkpoint import ResumeError, resolve_explicit, write_hf_model
from .run_dir import RunDir

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def export_checkpoint(checkpoint: Path, output: Path | None = None, dtype: str = "bfloat16", log=print,
                      merged: bool = False) -> Path:
    """Write the checkpoint as a Hugging Face model to `output`; a LoRA checkpoint as its adapter (output/adapter)
    and, with `merged`, the merged model (output/merged)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from transformers import AutoModelForCausalLM

    from .models import model_config, tokenizer_source
    from .tokenizer import load_tokenizer

    info = resolve_explicit(Path(checkpoint), lambda msg: log(f"warning: {msg}"))
    manifest = info.manifest
    model_name = manifest.get("model")
    if not model_name:
        raise ResumeError(f"{info.path / 'manifest.json'} does not name the model; it was not written by this project")
    tokenizer = load_tokenizer(tokenizer_source(manifest.get("tokenizer"), model_name))
    config = model_config(model_name, tokenizer)
    out = Path(output) if output else RunDir.of(info.path.parent).export

    if manifest.get("lora"):
        return export_adapter_checkpoint(info, manifest, tokenizer, out, dtype, merged, log)
    log(f"export: merging the fp32 weights of {info.path} (ZeRO stage {manifest.get('zero_stage')}, "
        f"{manifest.get('world_size')} ranks)")
    state_dict = get_fp32_state_dict_from_zero_checkpoint(str(info.path.parent), tag=info.path.name)
    target = DTYPES[dtype]
    for key in list(state_dict):
        state_dict[key] = state_dict[key].to(target)  # one tensor at a time: no second full copy
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=target)
    missing, unexpected = model.load_state_dict(state_dict, strict=False, assign=True)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
        missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        raise RuntimeError(f"{info.path}: weights do not match {model_name}: missing {missing[:5]}, unexpected "
                           f"{unexpected[:5]}")
    write_hf_model(model, tokenizer, out)
    log(f"export: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters ({dtype}) written to {out}")
    return out


def export_adapter_checkpoint(info, manifest: dict, tokenizer, out: Path, dtype: str, merged: bool, log) -> Path:
    """A LoRA checkpoint (adapters and their optimizer state, no frozen weight): the adapters' fp32 weights merged
    from the ranks' shards, loaded into the pretrained model wrapped again with the checkpoint's settings."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from .lora import LoraSettings, export_lora_checkpoint
    from .sft_data import attach_chat_template

    settings = LoraSettings.from_manifest(manifest["lora"])
    log(f"export: the LoRA adapters of {info.path} (rank {settings.rank}) on {manifest['model']}")
    state_dict = get_fp32_state_dict_from_zero_checkpoint(str(info.path.parent), tag=info.path.name,
                                                          exclude_frozen_parameters=True)
    attach_chat_template(tokenizer)  # as the run's own export: the template its chats were rendered with
    written = export_lora_checkpoint(manifest["model"], settings, state_dict, tokenizer, out, merged, DTYPES[dtype])
    log("export: " + "; ".join(f"{kind} written to {path}" for kind, path in written.items()))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", help="a step-XXXXXXXX directory, or a checkpoint directory (newest complete one)")
    parser.add_argument("--output", help="output directory (default: <checkpoint dir>/hf)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--merged", action="store_true", help="a LoRA checkpoint: also the merged model "
                                                               "(OUTPUT/merged), loadable without peft")
    args = parser.parse_args(argv)
    try:
        export_checkpoint(Path(args.checkpoint), Path(args.output) if args.output else None, args.dtype,
                          merged=args.merged)
    except ResumeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
