"""QLoRA's 4-bit base on CPU (bitsandbytes' CPU backend, fp32 compute): which layers are quantized and how, the
quantized outputs against the 16-bit ones within NF4's error, the adapters' gradients through the 4-bit layers,
training after an evaluation (patches.bitsandbytes_cpu), what a checkpoint holds, and the dequantized exports."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import require_bitsandbytes

require_bitsandbytes()

import bitsandbytes as bnb  # noqa: E402

from model_utils.config.settings import LoraSettings  # noqa: E402
from model_utils.models.lora import adapter_state_dict, apply_lora, export_qlora, lora_resume_problems  # noqa: E402
from model_utils.models.quantization import (BASE_QUANTIZATION_FILE, BLOCK, BYTES_PER_PARAM, Quantization,  # noqa: E402
                                             plain_tensor, prepare_for_training, prequantized_problems,
                                             quantizable_layers, quantize_layers, quantized_sizes)

CPU = Quantization("fp32", 2)
INPUTS = torch.arange(1, 17).reshape(2, 8)
# NF4's widest step, between its codes -1 and -0.6962: a weight rounds to a code at most half of it away, in units of
# its block's absmax (the quantizer scales each block of 64 by its absmax).
NF4_HALF_WIDEST_STEP = (1.0 - 0.6961928009986877) / 2


def tiny(family: str = "qwen3", seed: int = 0):
    import transformers

    torch.manual_seed(seed)
    if family == "gpt2":
        config = transformers.GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64)
    else:
        config = transformers.Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                          tie_word_embeddings=False)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def quantized(model, quantization: Quantization = CPU):
    """A deep copy of `model` with its linear layers in 4-bit, as the trainer builds a preset's."""
    import copy

    model = copy.deepcopy(model)
    quantize_layers(model, quantization, "cpu")
    prepare_for_training(model)
    return model


def test_every_linear_layer_but_the_head_is_quantized_nf4_with_double_quantization():
    model = tiny()
    expected = {name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear) and name != "lm_head"}
    params, largest = quantized_sizes(model)
    assert {name for name, _ in quantizable_layers(model)} == expected
    assert params == sum(m.weight.numel() for n, m in model.named_modules() if n in expected) and largest == 128 * 64
    four_bit = quantized(model)
    layers = {name: m for name, m in four_bit.named_modules() if isinstance(m, bnb.nn.Linear4bit)}
    assert set(layers) == expected and type(four_bit.lm_head) is torch.nn.Linear and four_bit.is_loaded_in_4bit
    for layer in layers.values():
        state = layer.weight.quant_state
        assert state.quant_type == "nf4" and state.nested and state.blocksize == BLOCK  # double quantization
        assert layer.weight.dtype == torch.uint8 and layer.compute_dtype == torch.float32 and not layer.weight.requires_grad
    # wrapped by peft, the adapters are linear layers too: never counted as 4-bit
    assert quantized_sizes(apply_lora(tiny(), LoraSettings(rank=4)))[0] == params


def test_the_settings_follow_the_runs_precision_and_zero3_stores_a_float_dtype():
    assert (Quantization("bf16", 2).compute_dtype, Quantization("bf16", 2).storage_dtype) == (torch.bfloat16, torch.uint8)
    assert Quantization("fp16", 3).storage_dtype == torch.float16  # ZeRO-3 partitions float parameters
    config = Quantization("bf16", 3).bnb_config()
    assert (config.load_in_4bit, config.bnb_4bit_quant_type, config.bnb_4bit_use_double_quant) == (True, "nf4", True)
    assert config.bnb_4bit_compute_dtype == torch.bfloat16 and config.bnb_4bit_quant_storage == torch.bfloat16
    assert BYTES_PER_PARAM == pytest.approx(0.5 + 0.127 / 8, abs=1e-4)  # QLoRA's 0.127 bits a parameter of constants
    zero3 = quantized(tiny(), Quantization("fp32", 3))
    assert zero3.model.layers[0].mlp.up_proj.weight.dtype == torch.float32  # 8 values in each fp32 element
    assert zero3.model.layers[0].mlp.up_proj.weight.numel() == 128 * 64 // 8


def test_each_4bit_weight_lies_within_nf4s_rounding_of_its_block():
    """|w - dequantized w| <= half NF4's widest step x the block's absmax c, plus what double quantization's 8-bit
    rounding of the absmax moves it (|c - c'|, c' the absmax as stored): the quantizer's own bound, exactly."""
    model = tiny()
    four_bit = quantized(model)
    original = dict(model.named_modules())
    for name, layer in four_bit.named_modules():
        if not isinstance(layer, bnb.nn.Linear4bit):
            continue
        weight = original[name].weight.detach().flatten().view(-1, BLOCK)
        state = layer.weight.quant_state
        stored = bnb.functional.dequantize_blockwise(state.absmax, state.state2) + state.offset  # c'
        absmax = weight.abs().amax(dim=1)
        error = (plain_tensor(layer.weight, torch.float32).flatten().view(-1, BLOCK) - weight).abs().amax(dim=1)
        assert torch.all(error <= NF4_HALF_WIDEST_STEP * absmax + (absmax - stored).abs() + 1e-7), name
        assert error.max() > 0.5 * NF4_HALF_WIDEST_STEP * absmax.max()  # quantized indeed, to 16 levels


def test_each_4bit_layers_output_lies_within_the_bound_its_weights_give():
    """With the 16-bit model's own inputs x of each layer: |y4 - y16| <= sum_j bound_ij |x_j| (the triangle
    inequality over the weights' bound above): the 4-bit layer adds no error beyond its weights' rounding."""
    model = tiny()
    four_bit = quantized(model)
    inputs = {}

    def keep_input(name):
        def hook(module, args, output):
            inputs[name] = args[0].detach()
        return hook

    hooks = [m.register_forward_hook(keep_input(name)) for name, m in quantizable_layers(model)]
    with torch.no_grad():
        model(INPUTS)
    for hook in hooks:
        hook.remove()
    layers = dict(four_bit.named_modules())
    for name, linear in quantizable_layers(model):
        x, layer = inputs[name], layers[name]
        weight = linear.weight.detach()
        state = layer.weight.quant_state
        stored = bnb.functional.dequantize_blockwise(state.absmax, state.state2) + state.offset
        absmax = weight.flatten().view(-1, BLOCK).abs().amax(dim=1)
        bound = (NF4_HALF_WIDEST_STEP * absmax + (absmax - stored).abs()).repeat_interleave(BLOCK).view_as(weight)
        with torch.no_grad():
            error = (layer(x) - linear(x)).abs()
        assert torch.all(error <= x.abs() @ bound.t() + 1e-5), name


def test_the_4bit_model_computes_exactly_the_16bit_model_of_its_dequantized_weights_forward_and_backward():
    """Outputs and the adapters' gradients: the 4-bit layers' only error is their weights' rounding."""
    model = tiny()
    four_bit = quantized(model)
    dequantized = tiny()
    with torch.no_grad():
        for name, layer in four_bit.named_modules():
            if isinstance(layer, bnb.nn.Linear4bit):
                dict(dequantized.named_modules())[name].weight.copy_(plain_tensor(layer.weight, torch.float32))
    settings = LoraSettings(rank=4, alpha=8, dropout=0.0)
    results = []
    for base in (four_bit, dequantized):
        torch.manual_seed(1)
        wrapped = apply_lora(base, settings)
        for name, p in wrapped.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.02)  # B starts at zero: give A a gradient too
        wrapped.train()
        loss = wrapped(INPUTS, labels=INPUTS).loss
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in wrapped.named_parameters() if p.requires_grad}))
    (loss4, grads4), (loss16, grads16) = results
    torch.testing.assert_close(loss4, loss16, rtol=1e-5, atol=1e-6)
    assert grads4.keys() == grads16.keys() and len(grads4) == 2 * 7 * 2  # A and B of 7 layers, 2 decoder layers
    for name in grads4:
        torch.testing.assert_close(grads4[name], grads16[name], rtol=1e-4, atol=1e-7)
    with torch.no_grad():
        assert (four_bit(INPUTS).logits - model(INPUTS).logits).abs().max() > 1e-3  # the rounding is there


def test_training_after_an_evaluation_keeps_its_gradients():
    """bitsandbytes >= 0.49 repacks a 4-bit layer for its CPU inference kernel the first time it runs in eval mode on
    an AVX512-BF16 CPU, after which its input gets no gradient (patches.bitsandbytes_cpu). With the trainer's layers,
    the evaluation computes what training computes, and the step after it the same gradients as the step before."""
    wrapped = apply_lora(quantized(tiny()), LoraSettings(rank=4, alpha=8, dropout=0.0, load_in_4bit=True))
    for name, p in wrapped.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)

    def step():
        wrapped.train()
        wrapped.zero_grad()
        loss = wrapped(INPUTS, labels=INPUTS).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in wrapped.named_parameters() if p.requires_grad}

    before = step()
    wrapped.eval()
    with torch.no_grad():
        evaluated = wrapped(INPUTS, labels=INPUTS).loss
    after = step()
    assert evaluated == before[0] and after[0] == before[0]
    assert all(torch.equal(after[1][name], grad) for name, grad in before[1].items())


def test_a_checkpoint_holds_the_adapters_only():
    """The 4-bit layers leave their quantization state out of state_dict; DeepSpeed leaves the frozen weights out
    (exclude_frozen_parameters), so what a checkpoint holds is the adapters."""
    wrapped = apply_lora(quantized(tiny()), LoraSettings(rank=4, load_in_4bit=True))
    frozen = {name for name, p in wrapped.named_parameters() if not p.requires_grad}
    kept = [key for key in wrapped.state_dict() if key not in frozen]
    assert kept and all("lora_" in key for key in kept)


@pytest.mark.parametrize("family", ["qwen3", "gpt2"])
def test_the_merged_export_is_the_adapters_on_the_dequantized_base_and_loads_without_bitsandbytes(family, tmp_path):
    """GPT-2's Conv1D layers become 4-bit linear layers (out x in) and return to Conv1D (in x out) in the export."""
    from transformers import AutoModelForCausalLM

    wrapped = apply_lora(quantized(tiny(family)), LoraSettings(rank=4, alpha=8, dropout=0.0, load_in_4bit=True)).eval()
    with torch.no_grad():
        for name, p in wrapped.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.05)
        expected = wrapped(INPUTS).logits
    state = {name: plain_tensor(t, torch.float32) for name, t in wrapped.state_dict(keep_vars=True).items()}
    written = export_qlora(wrapped, state, None, tmp_path, merged=True)
    config = json.loads((written["merged"] / "config.json").read_text())
    assert "quantization_config" not in config
    merged = AutoModelForCausalLM.from_pretrained(written["merged"]).eval()
    assert not any(isinstance(m, bnb.nn.Linear4bit) for m in merged.modules())
    with torch.no_grad():
        torch.testing.assert_close(merged(INPUTS).logits, expected, rtol=1e-4, atol=1e-5)
    assert json.loads((written["adapter"] / BASE_QUANTIZATION_FILE).read_text())["load_in_4bit"] is True
    assert adapter_state_dict(wrapped).keys()  # the adapter file holds the same adapters
    from safetensors.torch import load_file

    saved = load_file(written["adapter"] / "adapter_model.safetensors")
    for key, value in adapter_state_dict(wrapped).items():
        torch.testing.assert_close(saved[key], value)


def test_a_resume_that_changes_the_base_is_refused_with_the_fix():
    trained = LoraSettings(rank=4, load_in_4bit=True).as_manifest()
    [problem] = lora_resume_problems(trained, LoraSettings(rank=4), "ckpt/step-2")
    assert problem.setting == "--load_in_4bit" and "4-bit base" in problem.message and "pass --load_in_4bit" in problem.fix
    [problem] = lora_resume_problems(LoraSettings(rank=4).as_manifest(), LoraSettings(rank=4, load_in_4bit=True), "c")
    assert "16-bit base" in problem.message and "drop --load_in_4bit" in problem.fix
    old = {k: v for k, v in trained.items() if k != "load_in_4bit"}  # a manifest from before the setting: 16-bit
    assert lora_resume_problems(old, LoraSettings(rank=4), "c") == []


class Config:
    def __init__(self, quantization_config):
        self.quantization_config = quantization_config


BNB_4BIT = {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_compute_dtype": "bfloat16",
            "bnb_4bit_quant_storage": "uint8"}


@pytest.mark.parametrize("recorded, load_in_4bit, precision, stage, setting, says", [
    ({"quant_method": "gptq", "bits": 4}, True, "bf16", 2, "--model", "stored quantized (gptq)"),
    (BNB_4BIT, False, "bf16", 2, "--load_in_4bit", "holds 4-bit bitsandbytes weights"),
    (BNB_4BIT, True, "fp16", 2, "--model", "computes its 4-bit layers in bfloat16"),
    (BNB_4BIT, True, "bf16", 3, "--model", "stores its 4-bit values as uint8"),
    ({**BNB_4BIT, "bnb_4bit_quant_storage": "bfloat16", "bnb_4bit_compute_dtype": "float16"}, True, "fp16", 2,
     "--model", "stores its 4-bit values as bfloat16"),
])
def test_a_model_stored_quantized_trains_only_as_a_matching_4bit_base(recorded, load_in_4bit, precision, stage, setting,
                                                                      says):
    problems = prequantized_problems(Config(recorded), "org/model-bnb-4bit", load_in_4bit, precision, stage)
    assert problems and problems[0].setting == setting and says in problems[0].message and problems[0].fix


def test_a_model_stored_in_4bit_for_the_runs_precision_trains():
    assert prequantized_problems(Config(BNB_4BIT), "m", True, "bf16", 2) == []
    zero3 = {**BNB_4BIT, "bnb_4bit_quant_storage": "bfloat16"}
    assert prequantized_problems(Config(zero3), "m", True, "bf16", 3) == []
    assert prequantized_problems(Config(None), "m", False, "bf16", 2) == []
