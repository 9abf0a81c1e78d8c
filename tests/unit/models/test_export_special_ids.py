"""An exported preset carries the special ids of the tokenizer it trained with, in its config and its generation
config, so that generate() stops at the end of a document. The Qwen3 presets train with the project's tokenizer
(end of document: id 0), not with Qwen's (151645)."""

from __future__ import annotations

import json

import pytest
import torch

from model_utils.config.presets import PRESETS
from model_utils.data.tokenizer import load_tokenizer
from model_utils.models.build import model_config
from model_utils.models.export import write_hf_model


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_preset_takes_its_tokenizers_special_ids(preset):
    tokenizer = load_tokenizer(None)
    config = model_config(preset, tokenizer)
    assert config.eos_token_id == tokenizer.eos_token_id
    assert config.bos_token_id in (tokenizer.bos_token_id, tokenizer.eos_token_id)
    assert config.pad_token_id == tokenizer.pad_token_id
    assert len(tokenizer) <= config.vocab_size


def test_generation_of_an_exported_qwen3_preset_stops_at_the_end_of_document(tmp_path):
    """qwen3-0.6b's config with the project's tokenizer, shrunk to one small layer (its vocabulary and special ids
    kept). With the final norm's weights zero every logit is 0 and greedy decoding picks id 0, the tokenizer's end of
    document: generation from the exported directory ends after that one token instead of running to max_new_tokens."""
    from transformers import AutoModelForCausalLM, GenerationConfig, Qwen3Config

    tokenizer = load_tokenizer(None)
    assert tokenizer.eos_token_id == 0
    params = model_config("qwen3-0.6b", tokenizer).to_dict()
    params.pop("layer_types", None)  # one per layer: derived again for the one layer
    params.update(num_hidden_layers=1, hidden_size=64, intermediate_size=128, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=32)
    config = Qwen3Config.from_dict(params)
    assert (config.vocab_size, config.eos_token_id) == (151936, 0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        model.model.norm.weight.zero_()
    write_hf_model(model, tokenizer, tmp_path / "hf")

    assert json.loads((tmp_path / "hf" / "config.json").read_text())["eos_token_id"] == 0
    assert GenerationConfig.from_pretrained(tmp_path / "hf").eos_token_id == 0
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    prompt = tokenizer("Return the", return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        out = exported.generate(**prompt, max_new_tokens=20, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    assert out.shape[1] == prompt["input_ids"].shape[1] + 1 and out[0, -1].item() == 0
