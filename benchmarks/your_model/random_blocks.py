"""Random token blocks as a dataset of your own, for benchmarks/your_model_timing.py: data_args `blocks` items (default
512) of --seq_len tokens each, input_ids and their next tokens as labels, from a generator of --seed (the content does
not change a step's time; the preset side reads --dummy_data blocks alike)."""

import torch


def build(settings):
    generator = torch.Generator().manual_seed(settings.seed)
    count = int(settings.args.get("blocks", 512))
    tokens = torch.randint(0, len(settings.tokenizer), (count, settings.seq_len + 1), generator=generator)
    return [{"input_ids": row[:-1].clone(), "labels": row[1:].clone()} for row in tokens]
