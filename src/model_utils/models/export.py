"""A model as a Hugging Face directory (safetensors, config, tokenizer): from a running engine at the end of training
(ZeRO-3's partitions gathered one tensor at a time), or from any checkpoint on disk, on CPU, without GPUs (the
`python -m model_utils.export` command).

From disk it works for ZeRO stages 1, 2 and 3, offloaded or not: DeepSpeed's `zero_to_fp32` merges the fp32 master
weights from every rank's optimizer shards (never the possibly-empty 16-bit ZeRO-3 module weights). The model is built
on the meta device and takes those tensors as its parameters (`assign=True`), so only one full copy is ever in memory.
A LoRA checkpoint holds the adapters only: they are loaded into the pretrained model its manifest names, wrapped again
with the manifest's LoRA settings (models.lora.export_lora_checkpoint).
"""

from __future__ import annotations

from pathlib import Path

import torch

from model_utils.checkpoint.protocol import ResumeError, resolve_explicit
from model_utils.config.presets import is_preset
from model_utils.config.settings import LoraSettings
from model_utils.core.run_dir import RunDir
from model_utils.core.user_code import is_user_function
from model_utils.data.sft.formats import attach_chat_template
from model_utils.data.tokenizer import load_tokenizer
from model_utils.models.build import model_config, tokenizer_source
from model_utils.models.lora import export_lora_checkpoint

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def export_checkpoint(checkpoint: Path, output: Path | None = None, dtype: str = "bfloat16", log=print,
                      merged: bool = False) -> Path:
    """Write the checkpoint as a Hugging Face model to `output`; a LoRA checkpoint as its adapter (output/adapter)
    and, with `merged`, the merged model (output/merged)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from transformers import AutoModelForCausalLM

    info = resolve_explicit(Path(checkpoint), lambda msg: log(f"warning: {msg}"))
    manifest = info.manifest
    model_name = manifest.get("model")
    if not model_name:
        raise ResumeError(f"{info.path / 'manifest.json'} does not name the model; it was not written by this project")
    if is_user_function(model_name):  # a model of your own: its weights and how to build it (models.custom.export)
        return export_own_checkpoint(info, manifest, output, dtype, log)
    tokenizer = load_tokenizer(tokenizer_source(manifest.get("tokenizer"), model_name))
    config = model_config(model_name, tokenizer, rope_scaling=manifest.get("rope_scaling"))
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


def export_own_checkpoint(info, manifest: dict, output: Path | None, dtype: str, log) -> Path:
    """A model of your own's checkpoint: the fp32 weights merged from the ranks' shards, in `dtype`, written as the
    run's own export writes them (model.safetensors and trainer_model.json, from the manifest's model function, its
    path as the run resolved it, and model_args)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from model_utils.models.custom.contract import ModelSettings
    from model_utils.models.custom.export import write_export

    out = Path(output) if output else RunDir.of(info.path.parent).export
    state = get_fp32_state_dict_from_zero_checkpoint(str(info.path.parent), tag=info.path.name)
    state = {name: tensor.to(DTYPES[dtype]) for name, tensor in state.items()}
    settings = ModelSettings(args=manifest.get("model_args") or {}, seq_len=manifest.get("model_seq_len"),
                             seed=manifest.get("seed", 0))
    write_export(out, state, manifest.get("model_file") or manifest["model"], settings)
    log(f"export: your model's {sum(t.numel() for t in state.values()) / 1e6:.1f}M parameters ({dtype}) written to "
        f"{out} (models.custom.export.load_exported loads it)")
    return out


def export_adapter_checkpoint(info, manifest: dict, tokenizer, out: Path, dtype: str, merged: bool, log) -> Path:
    """A LoRA checkpoint (adapters and their optimizer state, no frozen weight): the adapters' fp32 weights merged
    from the ranks' shards, loaded into the pretrained model wrapped again with the checkpoint's settings."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    settings = LoraSettings.from_manifest(manifest["lora"])
    if is_preset(manifest["model"]):
        raise ResumeError(f"{info.path} holds the LoRA adapters of the preset {manifest['model']}, whose frozen "
                          "random weights are in no file: the run's own export writes its merged model "
                          "(--export_merged)")
    log(f"export: the LoRA adapters of {info.path} (rank {settings.rank}) on {manifest['model']}")
    state_dict = get_fp32_state_dict_from_zero_checkpoint(str(info.path.parent), tag=info.path.name,
                                                          exclude_frozen_parameters=True)
    attach_chat_template(tokenizer)  # as the run's own export: the template its chats were rendered with
    written = export_lora_checkpoint(manifest["model"], settings, state_dict, tokenizer, out, merged, DTYPES[dtype])
    if settings.vision_frozen is not None:  # a vision-language model: its processor beside it, as the run's export
        from transformers import AutoConfig

        from model_utils.data.vision.processor import load_processor

        processor = load_processor(manifest["model"], AutoConfig.from_pretrained(manifest["model"]).model_type)
        for path in written.values():
            processor.save_pretrained(path)
    log("export: " + "; ".join(f"{kind} written to {path}" for kind, path in written.items()))
    return out


# --------------------------------------------------------------------------------------------------------------------
# Export to a Hugging Face model directory
# --------------------------------------------------------------------------------------------------------------------
def write_hf_model(model, tokenizer, out_dir: Path, state_dict: dict | None = None):
    """safetensors + config (generation-ready: use_cache on) + tokenizer, for `from_pretrained`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    model.config.use_cache = True
    model.save_pretrained(out_dir, state_dict=state_dict, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)


def gathered_state_dict(model, dist, convert=None) -> dict | None:
    """The full state dict of a ZeRO-3 model on rank 0 (CPU tensors), None elsewhere. Every rank takes part. Each
    tensor whole as `convert(tensor)` makes it (default: a CPU copy); a model that is not partitioned gives its own."""
    import deepspeed

    state, first_name = {}, {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in first_name:  # tied weights: gathered once (on every rank alike), the same tensor twice
            if dist.is_main:
                state[name] = state[first_name[id(tensor)]]
            continue
        first_name[id(tensor)] = name
        with deepspeed.zero.GatheredParameters([tensor] if hasattr(tensor, "ds_id") else [], modifier_rank=None):
            if dist.is_main:
                state[name] = convert(tensor) if convert else tensor.detach().cpu().clone()
    return state if dist.is_main else None


def export_hf(engine, model, tokenizer, out_dir: Path, zero_stage: int, dist, log) -> Path | None:
    """Write safetensors + config + tokenizer that `AutoModelForCausalLM.from_pretrained` loads.

    ZeRO-3 parameters are partitioned: each is gathered in turn (DeepSpeed's public `GatheredParameters`, one tensor
    on the GPU at a time) into a full 16-bit state dict on rank 0, so the export is never silently empty.
    """
    if zero_stage == 3:
        state_dict = gathered_state_dict(model, dist)
    else:
        state_dict = model.state_dict() if dist.is_main else None
    if dist.is_main:
        if not state_dict:
            raise RuntimeError("export produced an empty state dict; refusing to write an empty model")
        write_hf_model(model, tokenizer, out_dir, state_dict)
        log(f"export: Hugging Face model written to {out_dir}")
    dist.barrier()
    return out_dir
