"""--checkpointed_layers: how many decoder layers --gradient_checkpointing recomputes. Its validation, the memory it
leaves kept in the estimate, the automatic count against the GPU's size, and the layers that do recompute in a real
forward and backward pass of the tiny model on the CPU."""

from __future__ import annotations

from pathlib import Path

import pytest

from model_utils.config.checks import validate_args
from model_utils.config.flags import parse_args
from model_utils.config.settings import TrainConfig

REPO = Path(__file__).resolve().parents[3]


def test_the_setting_needs_checkpointing_and_a_count_or_all_or_auto():
    assert parse_args([]).model.checkpointed_layers == "all"
    assert parse_args(["--gradient_checkpointing", "--checkpointed_layers", "auto"]).model.checkpointed_layers == "auto"
    assert parse_args(["--gradient_checkpointing", "--checkpointed_layers", "7"]).model.checkpointed_layers == 7
    with pytest.raises(SystemExit):
        parse_args(["--checkpointed_layers", "most"])
    problems = validate_args(TrainConfig.from_flags(checkpointed_layers=3))
    assert [(p.setting, p.value) for p in problems] == [("--checkpointed_layers", 3)]
    assert "add --gradient_checkpointing" in problems[0].fix
    problems = validate_args(TrainConfig.from_flags(gradient_checkpointing=True, checkpointed_layers=-1))
    assert [p.setting for p in problems] == ["--checkpointed_layers"]
    assert not validate_args(TrainConfig.from_flags(gradient_checkpointing=True, checkpointed_layers=0))


def test_each_layer_left_out_keeps_its_working_set_instead_of_its_input():
    """The layers left out are the last ones: the backward pass frees their working sets before it recomputes a layer,
    so the last layer is kept for free (its working set is the one a recomputation would need) and each further one
    costs its working set less the input a recomputed layer keeps."""
    from model_utils.data.tokenizer import load_tokenizer
    from model_utils.models.build import model_config
    from model_utils.models.memory import activation_bytes, eager_layer_activation_bytes_per_token

    config = model_config("qwen3-4b", load_tokenizer(None))
    layers = config.num_hidden_layers

    def acts(checkpointing, count=None):
        return activation_bytes(config, 4096, 16, checkpointing, True, True, 8, compiled=False,
                                checkpointed_layers=count)

    assert acts(True) == acts(True, layers) == acts(True, layers + 5)
    assert acts(True, 0) == acts(False)
    kept_input = 2 * 16 * 4096 * config.hidden_size
    working_set = 16 * 4096 * eager_layer_activation_bytes_per_token(config)  # ZeRO-3's eager layers
    assert acts(True, layers - 1) == pytest.approx(acts(True) - kept_input)
    for count in range(layers - 1):
        assert acts(True, count) - acts(True, count + 1) == pytest.approx(working_set - kept_input)


def _plan(monkeypatch, *flags, gpu_gib="79.2"):
    from model_utils.models import speed
    from model_utils.planning import plan as plan_module

    if gpu_gib is None:
        monkeypatch.delenv("GPU_MEMORY_GIB", raising=False)
    else:
        monkeypatch.setenv("GPU_MEMORY_GIB", gpu_gib)
    monkeypatch.setattr(speed, "liger_available", lambda: True)
    cfg = parse_args(["--model", "qwen3-4b", "--ds_config", str(REPO / "configs" / "zero3-offload.json"),
                      "--global_batch_tokens", "131072", "--micro_batch_size", "auto", "--dummy_data", "64",
                      "--checkpoint_dir", "/nonexistent/ckpt", "--no-export", *flags])
    return plan_module.make_plan(cfg, 1, decides=False)


def test_auto_recomputes_the_fewest_layers_that_fit_at_the_micro_batch_all_of_them_allow(monkeypatch, session_cache):
    """Qwen3-4B with configs/zero3-offload.json on one H100 at 131,072 tokens per step: with every layer recomputed the
    automatic micro-batch is 16 (x 2) at ~21 GiB; auto then lets the last layers keep their activations while the
    estimate stays within 90% of the GPU, and one layer fewer would not."""
    from model_utils.models.memory import AUTO_MEMORY_SHARE, GIB
    
    every = _plan(monkeypatch, "--gradient_checkpointing")
    auto = _plan(monkeypatch, "--gradient_checkpointing", "--checkpointed_layers", "auto")
    layers = auto.model.config.num_hidden_layers
    assert every.batch.micro == auto.batch.micro == 16
    assert every.memory.checkpointed_layers == layers and every.memory.checkpointed_layers_choice is None
    count = auto.memory.checkpointed_layers
    assert 0 < count < layers
    budget = AUTO_MEMORY_SHARE * 79.2 * GIB
    assert every.memory.phases.peak[1] < auto.memory.phases.peak[1] <= budget
    assert auto.memory_model.peak(auto.ds_config, 16, count - 1) > budget
    assert auto.memory.checkpointed_layers_choice == (f"auto: the fewest with which the run fits 90% of the GPU by the "
                                               f"estimate (~{auto.memory.phases.peak[1] / GIB:.1f} GiB of 79.2)")
    from model_utils.planning.preflight import check_plan
    assert (f"checkpointed layers: {count} of {layers} recompute (auto: the fewest"
            in "\n".join(check_plan(auto, check_data=False, check_disk=False).lines))

    bigger = _plan(monkeypatch, "--gradient_checkpointing", "--checkpointed_layers", "auto", gpu_gib="139.8")
    assert bigger.memory.checkpointed_layers < count  # an H200 keeps more layers' activations
    unknown = _plan(monkeypatch, "--gradient_checkpointing", "--checkpointed_layers", "auto", gpu_gib=None)
    assert unknown.memory.checkpointed_layers == layers and "no GPU size" in unknown.memory.checkpointed_layers_choice

    given = _plan(monkeypatch, "--gradient_checkpointing", "--checkpointed_layers", str(count))
    assert given.memory.checkpointed_layers == count and given.memory.phases.peak[1] == auto.memory.phases.peak[1]
    too_many = _plan(monkeypatch, "--gradient_checkpointing", "--checkpointed_layers", str(layers + 1))
    assert [(p.setting, p.value) for p in too_many.problems if p.setting == "--checkpointed_layers"] == [
        ("--checkpointed_layers", layers + 1)]
    assert _plan(monkeypatch).memory.checkpointed_layers is None


def test_a_model_whose_layers_cannot_be_checkpointed_one_by_one_is_refused(monkeypatch, session_cache):
    """A count or auto applies to transformers' per-layer checkpointing; a model without it (no layer subclasses
    GradientCheckpointingLayer) would recompute every layer while the plan counted fewer: refused, naming the fix."""
    from model_utils.planning import plan as plan_module

    monkeypatch.setattr(plan_module, "checkpointable_layers", lambda model: [])  # where the plan counts them
    plan = _plan(monkeypatch, "--gradient_checkpointing", "--checkpointed_layers", "auto")
    [problem] = [p for p in plan.problems if p.setting == "--checkpointed_layers"]
    assert problem.value == "auto" and "has 0 of its 36" in problem.message and "at all" in problem.fix
    assert plan.memory.checkpointed_layers == 36
    assert not [p for p in _plan(monkeypatch, "--gradient_checkpointing").problems
                if p.setting == "--checkpointed_layers"]


@pytest.mark.parametrize("count", [None, 1, 0])
def test_only_the_first_layers_recompute_in_the_backward_pass(count):
    """The tiny model trained one step on the CPU: a recomputing layer enters its MLP twice per step (forward and the
    backward's recomputation, which torch stops early once it has what the backward needs: hence a pre-hook), one
    that keeps its activations once."""
    import torch

    from model_utils.data.tokenizer import load_tokenizer
    from model_utils.models.build import build_model, checkpointable_layers, model_config

    tokenizer = load_tokenizer(None)
    model = build_model("tiny", model_config("tiny", tokenizer), torch.float32, "sdpa", True, count).train()
    layers = checkpointable_layers(model)
    assert len(layers) >= 2
    calls = [0] * len(layers)
    for index, layer in enumerate(layers):
        layer.mlp.register_forward_pre_hook(lambda *_, index=index: calls.__setitem__(index, calls[index] + 1))
    ids = torch.randint(0, len(tokenizer), (2, 32))
    model(input_ids=ids, labels=ids).loss.backward()
    recomputing = len(layers) if count is None else count
    assert calls == [2] * recomputing + [1] * (len(layers) - recomputing)
