"""The export of a model of your own, and its reload.

A transformers model (a PreTrainedModel your function returned) is exported as the text models are: save_pretrained.
Any other module: EXPORT_DIR/model.safetensors (its state dict, gathered whole from ZeRO-3's partitions) and
EXPORT_DIR/trainer_model.json (the function that builds it, as an absolute path, and its model_args), from which
`load_exported(EXPORT_DIR)` builds the module again and loads the weights:

    from model_utils.models.custom.export import load_exported
    model = load_exported("runs/mine/hf")
"""

from __future__ import annotations

import json
from pathlib import Path

from model_utils.core.user_code import split_spec
from model_utils.models.custom.contract import ModelSettings, build_user_model

CONFIG = "trainer_model.json"
WEIGHTS = "model.safetensors"


def portable_spec(spec: str) -> str:
    """FILE.py:FUNCTION with FILE absolute (the export loads from anywhere); module:FUNCTION as it is."""
    source, function = split_spec(spec)
    return f"{Path(source).resolve()}:{function}" if source.endswith(".py") else spec


def write_export(out_dir: Path, state: dict, spec: str, settings: ModelSettings) -> Path:
    """Write the weights (16-bit where they trained so, as the state dict holds them) and how to build the module."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {name: tensor.detach().contiguous().cpu() for name, tensor in state.items()}
    shared = {}
    for name, tensor in list(tensors.items()):  # tied weights: one storage saved once, under its first name
        key = (tensor.data_ptr(), tensor.shape)
        if key in shared:
            tensors[name] = tensor.clone()
        shared.setdefault(key, name)
    save_file(tensors, str(out_dir / WEIGHTS))
    (out_dir / CONFIG).write_text(json.dumps({"model": portable_spec(spec), "model_args": settings.args,
                                              "seq_len": settings.seq_len, "seed": settings.seed}, indent=2) + "\n")
    return out_dir


def load_exported(directory: str | Path, tokenizer=None):
    """The module an export holds: built by its function with its model_args, its weights loaded (as fp32), in eval
    mode."""
    import torch
    from safetensors.torch import load_file

    directory = Path(directory)
    config = json.loads((directory / CONFIG).read_text())
    if tokenizer is None:
        from model_utils.data.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(None)
    settings = ModelSettings(args=config.get("model_args") or {}, tokenizer=tokenizer, seq_len=config.get("seq_len"),
                             seed=config.get("seed", 0))
    model = build_user_model(config["model"], settings)
    state = load_file(str(directory / WEIGHTS))
    missing, unexpected = model.load_state_dict({k: v.to(torch.float32) for k, v in state.items()}, strict=False)
    if missing or unexpected:
        raise ValueError(f"{directory}: the weights do not fit the module its function builds (missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]})")
    return model.eval()
