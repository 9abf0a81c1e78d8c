"""LoRA through peft on tiny models of each family (built from configs, no hub): the adapted layers, what trains,
the counts the memory estimate takes, and the exports transformers and peft load."""

from __future__ import annotations

import pytest
import torch

from model_utils.config.settings import LoraSettings, parse_target_modules
from model_utils.models.build import enable_activation_checkpointing
from model_utils.models.lora import (DEFAULT_TARGET_MODULES, LoraError, apply_lora, export_lora, lora_parameter_counts,
                                     lora_resume_problems, parameter_counts, summary, trainable_parameters)

TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2)


def tiny_config(family: str):
    import transformers

    if family == "gpt2":
        return transformers.GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=4, n_positions=64)
    classes = {"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config",
               "gemma": "GemmaConfig"}
    extra = {"head_dim": 8} if family in ("qwen3", "gemma") else {}
    return getattr(transformers, classes[family])(**TINY, **extra)


def tiny_model(family: str, seed: int = 0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_config(family)).eval()


FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma", "gpt2"]
INPUTS = torch.arange(1, 17).reshape(2, 8)


def adapted_layers(model) -> set[str]:
    return {name.split(".lora_A.")[0].rsplit(".", 1)[-1] for name, _ in model.named_parameters() if ".lora_A." in name}


@pytest.mark.parametrize("family", FAMILIES)
def test_the_family_default_adapts_every_attention_and_mlp_layer_and_only_adapters_train(family):
    model = apply_lora(tiny_model(family), LoraSettings(rank=4, alpha=8))
    assert adapted_layers(model) == set(DEFAULT_TARGET_MODULES[family])
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    # each adapter: rank x in + out x rank
    adapters = [m for m in model.modules() if hasattr(m, "lora_A") and "default" in m.lora_A]
    in_out = [(m.lora_A["default"].in_features, m.lora_B["default"].out_features) for m in adapters]
    assert parameter_counts(model).trainable == sum(4 * (i + o) for i, o in in_out)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_wrapped_model_starts_as_the_pretrained_one(family):
    base = tiny_model(family)
    with torch.no_grad():
        before = base(INPUTS).logits.clone()
        after = apply_lora(base, LoraSettings(rank=4)).eval()(INPUTS).logits
    torch.testing.assert_close(after, before)


def test_the_optimizer_groups_hold_only_the_adapters():
    from model_utils.models.build import decay_groups

    model = apply_lora(tiny_model("qwen3"), LoraSettings(rank=4))
    matrices, others = decay_groups(model.parameters())
    assert sum(p.numel() for p in matrices + others) == parameter_counts(model).trainable
    assert len(trainable_parameters(model)) == len(matrices) + len(others)


@pytest.mark.parametrize("family", ["qwen3", "gpt2"])
def test_counts_from_the_config_alone_match_the_built_model(family):
    settings = LoraSettings(rank=8)
    built = parameter_counts(apply_lora(tiny_model(family), settings))
    assert lora_parameter_counts(tiny_config(family), settings) == built
    full = lora_parameter_counts(tiny_config(family), None)
    assert full.frozen == 0 and full.trainable == built.frozen


def test_rank_sets_the_trainable_count():
    small, large = (lora_parameter_counts(tiny_config("llama"), LoraSettings(rank=r)) for r in (4, 8))
    assert large.trainable == 2 * small.trainable and large.frozen == small.frozen
    assert "trainable of" in summary(apply_lora(tiny_model("llama"), LoraSettings(rank=4)), LoraSettings(rank=4)).describe()


def test_named_targets_replace_the_default_and_unknown_names_are_problems():
    model = apply_lora(tiny_model("llama"), LoraSettings(rank=4, target_modules=parse_target_modules("q_proj, v_proj")))
    assert adapted_layers(model) == {"q_proj", "v_proj"}
    with pytest.raises(LoraError) as error:
        apply_lora(tiny_model("llama"), LoraSettings(target_modules=("c_attn",)))
    problem = error.value.problems[0]
    assert problem.setting == "--lora_target_modules" and problem.value == "c_attn"
    assert "q_proj" in problem.fix and "down_proj" in problem.fix


def test_bad_values_are_problems_before_any_model():
    problems = LoraSettings(rank=0, alpha=-1, dropout=1.0, target_modules=()).problems()
    assert [p.setting for p in problems] == ["--lora_rank", "--lora_alpha", "--lora_dropout", "--lora_target_modules"]
    assert parse_target_modules("auto") is None and parse_target_modules("") is None


def test_a_resume_needs_the_checkpoints_adapters():
    recorded = LoraSettings(rank=8).as_manifest()
    assert lora_resume_problems(recorded, LoraSettings(rank=8), "step-10") == []
    assert lora_resume_problems(recorded, LoraSettings(rank=8, dropout=0.1), "step-10") == []  # dropout: no shape
    problem = lora_resume_problems(recorded, LoraSettings(rank=16), "step-10")[0]
    assert "rank 8 -> 16" in problem.message
    assert "without LoRA" in lora_resume_problems(None, LoraSettings(), "step-10")[0].message


def test_adapters_reach_gradients_through_checkpointed_layers():
    base = tiny_model("qwen3").train()
    enable_activation_checkpointing(base)
    model = apply_lora(base, LoraSettings(rank=4, dropout=0.0))
    model(INPUTS, labels=INPUTS).loss.backward()
    adapters = {n: p for n, p in model.named_parameters() if ".lora_A." in n or ".lora_B." in n}
    assert all(p.grad is not None for p in adapters.values())
    # B starts at zero, so A's first gradient is zero too; B's is not
    assert all(p.grad.abs().sum() > 0 for n, p in adapters.items() if ".lora_B." in n)


def _train_a_little(model):
    optimizer = torch.optim.AdamW(trainable_parameters(model), lr=1e-2)
    model.train()
    for _ in range(3):
        optimizer.zero_grad()
        model(INPUTS, labels=INPUTS).loss.backward()
        optimizer.step()
    return model.eval()


@pytest.mark.parametrize("family", FAMILIES)
def test_exports_the_adapter_for_peft_and_a_merged_model_for_transformers_alone(family, tmp_path):
    from peft import PeftModel
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    tiny_model(family).save_pretrained(tmp_path / "base")  # the "pretrained" model, on disk
    model = _train_a_little(apply_lora(AutoModelForCausalLM.from_pretrained(tmp_path / "base"),
                                       LoraSettings(rank=4, dropout=0.0)))
    with torch.no_grad():
        expected = model(INPUTS).logits
    written = export_lora(model, None, tmp_path / "export", merged=True)
    assert adapted_layers(model)  # the merge worked on a copy

    merged = AutoModelForCausalLM.from_pretrained(written["merged"]).eval()
    with safe_open(written["merged"] / "model.safetensors", "pt") as f:
        assert not any("lora" in key for key in f.keys())
    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "base"),
                                         written["adapter"]).eval()
    with torch.no_grad():
        base_logits = AutoModelForCausalLM.from_pretrained(tmp_path / "base")(INPUTS).logits
        torch.testing.assert_close(merged(INPUTS).logits, expected, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(reloaded(INPUTS).logits, expected, rtol=1e-5, atol=1e-5)
    assert (expected - base_logits).abs().max() > 1e-3  # training changed the model
