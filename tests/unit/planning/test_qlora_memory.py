"""The memory estimate of a QLoRA run (--load_in_4bit): 4-bit weights at 0.516 byte a parameter where ZeRO puts them,
one dequantized working copy, and what follows for a Llama-3.1-8B-shaped model on a 15 GiB GPU (the automatic
micro-batch, the longest sequence). Arithmetic only: the estimate's accuracy on GPUs is not measured for QLoRA."""

from __future__ import annotations

import pytest

from model_utils.models.memory import (GIB, HOST_STATE_OVERHEAD, QuantizedBase, model_state_bytes,
                                       offload_host_bytes)
from model_utils.models.quantization import BYTES_PER_PARAM

# Llama 3.1 8B's linear layers in its 32 decoder layers: q and o 4096 x 4096, k and v 1024 x 4096, gate, up and down
# 14,336 x 4096; the embedding and the LM head (128,256 x 4096 each) stay 16-bit.
LLAMA_8B_QUANTIZED = 32 * (2 * 4096 * 4096 + 2 * 1024 * 4096 + 3 * 14_336 * 4096)
LLAMA_8B_LARGEST = 14_336 * 4096


def test_4bit_weights_count_at_their_bytes_where_zero_puts_them():
    """Of the frozen weights, the 4-bit ones take BYTES_PER_PARAM each, the rest 2 (16-bit): on every GPU under
    ZeRO-1/2, a rank's share under ZeRO-3, on the host where ZeRO-3 offloads the parameters."""
    frozen, quantized, world = 8 * 10**9, QuantizedBase(7 * 10**9, 10**8), 4
    four_bit = 2 * 10**9 + BYTES_PER_PARAM * 7 * 10**9
    assert model_state_bytes(0, world, 2, False, False, True, frozen_params=frozen, quantized=quantized) == four_bit
    assert model_state_bytes(0, world, 3, False, False, True, frozen_params=frozen,
                             quantized=quantized) == pytest.approx(four_bit / world)
    assert model_state_bytes(0, world, 2, False, False, False, frozen_params=frozen,
                             quantized=quantized) == 4 * 10**9 + BYTES_PER_PARAM * 7 * 10**9  # fp32 elsewhere
    host = offload_host_bytes(0, world, 1, 3, True, True, False, frozen_params=frozen, quantized=quantized)
    assert host - 8 * GIB == pytest.approx(four_bit / world * HOST_STATE_OVERHEAD)
    assert quantized.working_bytes(bf16=True) == 2 * 10**8 and quantized.working_bytes(bf16=False) == 4 * 10**8


def llama_8b_plan(monkeypatch, tmp_path, *flags, gib: float = 15):
    from model_utils.config.flags import parse_args
    from model_utils.models import speed
    from model_utils.planning.plan import make_plan

    monkeypatch.setenv("GPU_MEMORY_GIB", str(gib))
    monkeypatch.setattr(speed, "liger_available", lambda: True)  # the GPU nodes have Liger's fused loss
    cfg = parse_args(["--model", "llama-8b", "--ds_config", "configs/fp16.json", "--lora_rank", "16",
                      "--gradient_checkpointing", "--seq_len", "2048", "--checkpoint_dir", str(tmp_path), *flags])
    return make_plan(cfg, 1, decides=False)


def test_llama_8b_qlora_fits_a_15_gib_gpu_where_16bit_lora_does_not(monkeypatch, tmp_path):
    """A T4's 15 GiB: the 16-bit frozen weights alone (15 GiB) leave nothing, the 4-bit ones (3.6 GiB) a micro-batch
    of several 2,048-token blocks. Between the two estimates at the same micro-batch lies exactly what the 4-bit
    weights save, less the working copy (both with eager layers, as 4-bit layers run)."""
    qlora = llama_8b_plan(monkeypatch, tmp_path, "--load_in_4bit")
    lora = llama_8b_plan(monkeypatch, tmp_path, "--micro_batch_size", str(qlora.batch.micro), "--compile", "off")
    quantized = qlora.model.quantized
    assert (quantized.params, quantized.largest) == (LLAMA_8B_QUANTIZED, LLAMA_8B_LARGEST)
    assert lora.model.quantized is None and qlora.model.frozen_params == lora.model.frozen_params
    assert qlora.batch.micro >= 2 and "the largest that fits 90% of 15 GiB" in qlora.micro_batch_choice
    saved = (2 - BYTES_PER_PARAM) * LLAMA_8B_QUANTIZED - 2 * LLAMA_8B_LARGEST  # fp16: a 2-byte working copy
    assert lora.memory.phases.train - qlora.memory.phases.train == pytest.approx(saved, rel=1e-9)
    assert lora.memory.phases.train > 15 * GIB >= qlora.memory.phases.train
    assert not qlora.compiled_layers  # 4-bit layers run eager


def test_the_longest_sequence_the_preflight_names_reflects_the_4bit_base(monkeypatch, tmp_path):
    """On 24 GiB (an L4's, an A10's): of the 21.6 GiB an automatic choice fills, the 16-bit weights leave ~6 GiB for
    the rest, the 4-bit ones ~18: more than twice the tokens (8,192 and 23,552 by the estimate)."""
    from model_utils.planning.memory_checks import longest_sequence

    qlora = llama_8b_plan(monkeypatch, tmp_path, "--load_in_4bit", "--micro_batch_size", "1", gib=24)
    lora = llama_8b_plan(monkeypatch, tmp_path, "--micro_batch_size", "1", "--compile", "off", gib=24)
    assert longest_sequence(lora, 1) >= 4096 and longest_sequence(qlora, 1) > 2 * longest_sequence(lora, 1)


def test_a_vision_language_models_4bit_weights_are_its_language_models_linear_layers(monkeypatch, tmp_path):
    """qwen2.5-vl-7b (Qwen2.5-VL-7B-Instruct's dimensions), its tower frozen as a pretrained model's: the 4-bit weights
    are the decoder's linear layers (28 x q, k, v, o, gate, up, down: 6.53B); the vision tower and its merger, the
    embeddings and the LM head are counted in 16-bit. Between the QLoRA and the 16-bit LoRA estimates at the same
    micro-batch lies exactly what those 4-bit weights save, less one working copy (bf16: 2 bytes)."""
    from model_utils.config.flags import parse_args
    from model_utils.planning.plan import make_plan

    monkeypatch.setenv("GPU_MEMORY_GIB", "80")

    def plan(*flags):
        cfg = parse_args(["--model", "qwen2.5-vl-7b", "--freeze", "vision_tower", "--lora_rank", "16", "--seq_len",
                          "4096", "--gradient_checkpointing", "--checkpoint_dir", str(tmp_path), *flags])
        return make_plan(cfg, 1, decides=False)

    qlora = plan("--load_in_4bit")
    lora = plan("--micro_batch_size", str(qlora.batch.micro), "--compile", "off")
    text = qlora.model.config  # the language model's
    hidden, inter, kv = (text.hidden_size, text.intermediate_size,
                        text.num_key_value_heads * text.hidden_size // text.num_attention_heads)
    linear = text.num_hidden_layers * (2 * hidden * hidden + 2 * kv * hidden + 3 * inter * hidden)
    assert (qlora.model.quantized.params, qlora.model.quantized.largest) == (linear, inter * hidden)
    assert round(linear / 1e9, 2) == 6.53 and lora.model.quantized is None
    parts = qlora.model.vision.part_params
    assert qlora.model.frozen_params == lora.model.frozen_params > linear + parts["vision_tower"]  # the tower 16-bit
    saved = (2 - BYTES_PER_PARAM) * linear - 2 * inter * hidden
    assert lora.memory.phases.train - qlora.memory.phases.train == pytest.approx(saved, rel=1e-9)
