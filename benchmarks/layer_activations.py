"""What one decoder layer keeps for its backward pass, per token, measured on the GPU: the data behind
`models.memory.layer_activation_bytes_per_token` (compiled layers) and
`models.memory.eager_layer_activation_bytes_per_token`.

For each model it builds the preset with 1 and with 3 decoder layers, applies the trainer's speed options (the same
`apply_speed_options`) and, with --lora_rank, LoRA's adapters after them as the trainer does, and reads the memory a
forward pass leaves allocated for the backward at micro-batches 1 and 2.
The difference between 3 layers and 1, over 2 layers and the batch's tokens, is one layer's activations per token;
the embedding, the loss and the logits cancel. One JSON line per model, layer count and micro-batch goes to --json.

    python benchmarks/layer_activations.py --models qwen3-0.6b qwen3-4b qwen3-8b --compile layers --json out.jsonl
    python benchmarks/layer_activations.py --models llama-1b --seq_len 2048 --lora_rank 16 --lora_dropout 0.05
"""

from __future__ import annotations

import argparse
import json
import sys

from common import GIB, normalize_env

LAYER_COUNTS = (1, 3)
MICRO_BATCHES = (1, 2)


def measure(model_name: str, layers: int, micros, seq_len: int, perf, log, lora=None) -> list[dict]:
    """Memory a forward pass leaves allocated for its backward, for each micro-batch (after one warm-up pass each,
    which compiles). `lora`: config.settings.LoraSettings, or None for no adapters."""
    import torch

    from model_utils.models.build import build_model, model_config
    from model_utils.models.lora import adapter_activations, apply_lora
    from model_utils.models.memory import eager_layer_activation_bytes_per_token, layer_activation_bytes_per_token
    from model_utils.models.speed import apply_speed_options

    config = model_config(model_name)
    config.num_hidden_layers = layers
    model = build_model(model_name, config, torch.bfloat16, "sdpa", gradient_checkpointing=False)
    model.to("cuda")
    applied = apply_speed_options(model, perf, cuda=True, log=log)
    lora_estimate = {"compiled": 0.0, "eager": 0.0}
    if lora is not None:
        model = apply_lora(model, lora)
        adapters = adapter_activations(model, lora, layers)
        lora_estimate = {kind: adapters.bytes_per_token(compiled=kind == "compiled") for kind in lora_estimate}
        applied = {**applied, "lora": f"rank {lora.rank} dropout {lora.dropout}"}
    model.train()
    rows = []
    for micro in micros:
        tokens = torch.randint(0, config.vocab_size, (micro, seq_len + 1), device="cuda")
        inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        batch = {"input_ids": inputs, "labels": targets, "shift_labels": targets}
        for _ in range(2):  # the first pass compiles (and may recompile for the new batch size)
            model.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            before = torch.cuda.memory_allocated()
            loss = model(**batch, use_cache=False).loss
            torch.cuda.synchronize()
            kept = torch.cuda.memory_allocated() - before
            loss.backward()
            del loss
        rows.append({"model": model_name, "layers": layers, "micro_batch_size": micro, "seq_len": seq_len,
                     "kept_bytes": kept, "levers": applied, "lora_rank": lora.rank if lora else 0,
                     "lora_dropout": lora.dropout if lora else None, "hidden_size": config.hidden_size,
                     "intermediate_size": config.intermediate_size,
                     "estimate_compiled_bytes_per_token": layer_activation_bytes_per_token(config)
                     + lora_estimate["compiled"],
                     "estimate_eager_bytes_per_token": eager_layer_activation_bytes_per_token(config)
                     + lora_estimate["eager"]})
        log(f"{model_name} {layers} layer(s) micro {micro}: {kept / GIB:.2f} GiB kept after the forward")
    del model
    torch.cuda.empty_cache()
    return rows


def per_layer(rows: list[dict]) -> list[dict]:
    """One layer's bytes per token at each micro-batch: (kept with 3 layers - kept with 1) / 2 / tokens."""
    out = []
    for micro in MICRO_BATCHES:
        pair = {r["layers"]: r for r in rows if r["micro_batch_size"] == micro}
        if set(LAYER_COUNTS) <= set(pair):
            low, high = pair[LAYER_COUNTS[0]], pair[LAYER_COUNTS[1]]
            tokens = micro * low["seq_len"]
            measured = (high["kept_bytes"] - low["kept_bytes"]) / (LAYER_COUNTS[1] - LAYER_COUNTS[0]) / tokens
            out.append({"model": low["model"], "micro_batch_size": micro, "bytes_per_token": measured,
                        "per_hidden": measured / low["hidden_size"], "levers": low["levers"],
                        "lora_rank": low["lora_rank"], "lora_dropout": low["lora_dropout"],
                        "estimate_compiled": low["estimate_compiled_bytes_per_token"],
                        "estimate_eager": low["estimate_eager_bytes_per_token"]})
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["qwen3-0.6b", "qwen3-4b", "qwen3-8b"])
    p.add_argument("--seq_len", type=int, default=4096)
    p.add_argument("--compile", choices=("layers", "off"), default="layers")
    p.add_argument("--attention_kernel", choices=("auto", "fa4", "sdpa"), default="auto")
    p.add_argument("--lora_rank", type=int, default=0, help="LoRA's adapters of this rank on the family's default "
                   "layers (0: none)")
    p.add_argument("--lora_dropout", type=float, default=0.05)
    p.add_argument("--json", help="append the measurements (one line per model, layer count and micro-batch) here")
    a = p.parse_args(argv)
    normalize_env()
    import torch

    from model_utils.config.settings import LoraSettings, SpeedConfig

    if not torch.cuda.is_available():
        print("layer_activations.py measures GPU memory: no GPU here", file=sys.stderr)
        return 2
    perf = SpeedConfig(compile=a.compile, attention_kernel=a.attention_kernel)
    lora = LoraSettings(rank=a.lora_rank, dropout=a.lora_dropout) if a.lora_rank else None
    for name in a.models:
        rows = [row for layers in LAYER_COUNTS
                for row in measure(name, layers, MICRO_BATCHES, a.seq_len, perf, lambda m: print(f"  {m}"), lora)]
        for line in per_layer(rows):
            print(f"{line['model']} micro {line['micro_batch_size']}: {line['bytes_per_token']:,.0f} bytes per token "
                  f"and layer ({line['per_hidden']:.2f} h); the estimate counts {line['estimate_compiled']:,.0f} "
                  f"compiled, {line['estimate_eager']:,.0f} eager (with its margin); levers {line['levers']}",
                  flush=True)
            rows.append({"kind": "per_layer", **line})
        if a.json:
            with open(a.json, "a") as f:
                for row in rows:
                    f.write(json.dumps({"compile": a.compile, "attention_kernel": a.attention_kernel, **row}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
