"""A model of your own with a preset's architecture, for benchmarks/your_model_timing.py: transformers' causal LM of
the preset named by model_args `preset` (default qwen3-0.6b) inside a plain module whose forward takes a block's
`input_ids` and `labels` (already shifted: labels[t] is the token after position t) and returns the mean loss.
The same architecture, weights and kernels as `--model PRESET` with the trainer's speed options off: what the
comparison measures is the extension point's own cost."""

import torch
import torch.nn.functional as F
from torch import nn


class PresetModel(nn.Module):
    def __init__(self, preset, tokenizer):
        super().__init__()
        from transformers import AutoModelForCausalLM

        from model_utils.models.build import model_config

        self.lm = AutoModelForCausalLM.from_config(model_config(preset, tokenizer), attn_implementation="sdpa")

    def forward(self, input_ids, labels):
        logits = self.lm(input_ids=input_ids, use_cache=False).logits
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def build(settings):
    return PresetModel(settings.args.get("preset", "qwen3-0.6b"), settings.tokenizer)
