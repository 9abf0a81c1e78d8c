"""The parameters the benchmarks' FLOPs and MFU count (report.base_parameters) of a 4-bit base on CPU (bitsandbytes'
CPU backend): each quantized weight by its values, not its packed storage, as the trainer's own log counts them; for
the trainer's 4-bit layers (bytes, and ZeRO-3's float storage) and for a model transformers loads in 4-bit as TRL does
for the QLoRA peer; LoRA's adapters left out."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
from conftest import require_bitsandbytes

require_bitsandbytes()

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))

from model_utils.config.settings import LoraSettings  # noqa: E402
from model_utils.models.lora import apply_lora, meta_model, parameter_counts  # noqa: E402
from model_utils.models.quantization import Quantization, prepare_for_training, quantize_layers  # noqa: E402

LORA = LoraSettings(rank=4, load_in_4bit=True)


@pytest.fixture(scope="module")
def tiny():
    """A Qwen3-shaped model with untied embeddings, and its parameters as the trainer's log counts a LoRA run's base
    (the frozen parameters of the model with adapters, built on the meta device)."""
    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      tie_word_embeddings=False)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    counted = parameter_counts(meta_model(config, LORA)).frozen
    assert counted == sum(p.numel() for p in model.parameters())
    return model, counted


def packed_size(model) -> int:
    """What the benchmarks counted before: each parameter's storage elements."""
    return sum(p.numel() for name, p in model.named_parameters() if "lora_" not in name)


@pytest.mark.parametrize("quantization", [Quantization("fp32", 2), Quantization("fp32", 3)], ids=["bytes", "zero3"])
def test_ours_counts_each_4bit_weight_by_its_values(tiny, quantization):
    import report

    model, counted = tiny
    model = copy.deepcopy(model)
    assert quantize_layers(model, quantization, "cpu") == 14  # 7 linear layers a decoder layer
    prepare_for_training(model)
    wrapped = apply_lora(model, LORA)
    assert packed_size(wrapped) < 0.6 * counted  # the storage packs 2 values a byte, 8 an fp32 element
    assert report.base_parameters(wrapped) == counted


def test_the_trl_peers_4bit_model_is_counted_as_ours(tiny, tmp_path):
    """sft_peers' TRL + peft + bitsandbytes: transformers loads the saved model with the peer's BitsAndBytesConfig,
    peft adds the adapters."""
    import report
    import sft_peers
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    model, counted = tiny
    model.save_pretrained(tmp_path)
    quantization = BitsAndBytesConfig(**{**sft_peers.bnb_4bit(cuda=False), "bnb_4bit_compute_dtype": torch.float32})
    peer = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, quantization_config=quantization,
                                                device_map="cpu")
    peer = get_peft_model(peer, LoraConfig(task_type="CAUSAL_LM", r=4, target_modules="all-linear"))
    assert sum("lora_" in name for name, _ in peer.named_parameters()) == 28  # A and B of 14 layers
    assert packed_size(peer) < 0.6 * counted
    assert report.base_parameters(peer) == counted
