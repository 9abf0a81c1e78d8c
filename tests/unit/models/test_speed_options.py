"""The speed options (SpeedConfig, model_utils/speed.py) on CPU: flags, validation with every other problem, their
record in the manifest and the resume check, and the fall-backs that keep CPU runs and CI on the trainer's code path."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from model_utils.config.checks import speed_problems, validate_args
from model_utils.config.flags import build_parser, parse_args
from model_utils.config.settings import SpeedConfig, TrainConfig
from model_utils.models import speed
from model_utils.patches import flash_attn4

REPO = Path(__file__).resolve().parents[3]


def _tiny_model():
    from model_utils.data.tokenizer import load_tokenizer
    from model_utils.models.build import build_model, model_config

    return build_model("tiny", model_config("tiny", load_tokenizer(None)), __import__("torch").float32, "sdpa", False)


def test_levers_are_flags_in_their_own_help_group():
    cfg = parse_args(["--compile", "off", "--flce_chunk_budget", "4", "--activation_budget", "0.75",
                      "--attention_kernel", "sdpa", "--max_steps", "5"])
    assert cfg.speed == SpeedConfig(compile="off", flce_chunk_budget=4, activation_budget=0.75, attention_kernel="sdpa")
    assert {"compile", "flce_chunk_budget", "activation_budget", "attention_kernel", "max_steps"} == cfg.explicit
    assert parse_args([]).speed == SpeedConfig()
    help_text = build_parser().format_help()
    group = help_text[help_text.index("speed options"):]
    for name in SpeedConfig().as_dict():
        assert f"--{name}" in group
    with pytest.raises(SystemExit):
        parse_args(["--flce_chunk_budget", "3"])


def test_bad_levers_are_reported_with_every_other_problem(tmp_path):
    cfg = TrainConfig.from_flags(max_steps=0, ds_config=str(tmp_path / "missing.json"),
                      speed=SpeedConfig(compile="fast", activation_budget=1.5))
    settings = [p.setting for p in validate_args(cfg)]
    assert {"--max_steps", "--ds_config", "--compile", "--activation_budget"} <= set(settings)


def test_a_retired_environment_switch_is_refused_naming_its_flag():
    problems = speed_problems(SpeedConfig(), environ={"DSLM_COMPILE": "off", "DSLM_GRAD_NORM": "foreach", "HOME": "/"})
    assert [p.setting for p in problems] == ["DSLM_COMPILE", "DSLM_GRAD_NORM"]
    assert "--compile" in problems[0].fix and "unset DSLM_COMPILE" in problems[0].fix
    assert speed_problems(SpeedConfig(), environ={}) == []


def test_a_resume_names_the_levers_that_change_the_numerics():
    from model_utils.train import resume

    saved = {"perf": SpeedConfig().as_dict(), "levers_in_force": {"attention_kernel": "fa4", "compile": "layers",
                                                                 "overflow_check": "device"}}
    same = resume.speed_changes(saved, SpeedConfig(), {"attention_kernel": "fa4", "compile": "layers",
                                                               "overflow_check": "device"})
    assert same == []
    # The overflow check skips the same steps in every mode: not a numerics change. An `auto` that chose another kernel
    # on this machine is one, and so is a setting changed by hand.
    changed = resume.speed_changes(saved, SpeedConfig(overflow_check="scan", flce_chunk_budget=1),
                                            {"attention_kernel": "sdpa", "compile": "layers", "overflow_check": "scan"})
    assert changed == ["flce_chunk_budget: 8 -> 1", "attention_kernel in force: fa4 -> sdpa"]
    assert resume.speed_changes({}, SpeedConfig(compile="off"), {"compile": "off"}) == []  # older manifests


def test_a_resume_names_a_changed_delayed_update():
    """--delayed_update_from_step changes which gradients each update uses: a resume says so where the steps after
    the resume point are delayed otherwise than the run that wrote the checkpoint would have delayed them."""
    from model_utils.train import resume

    def changes(saved_from, now_from, resumed_at):
        saved = {"perf": SpeedConfig().as_dict(), "levers_in_force": {"delayed_update_from_step": saved_from}}
        return resume.speed_changes(saved, SpeedConfig(), {"delayed_update_from_step": now_from}, resumed_at)

    assert changes(5, 5, 30) == [] and changes(0, 0, 30) == []
    assert changes(5, 20, 30) == []  # both delay every step from 31 on
    assert changes(5, 40, 30) == ["delayed update: from step 31 -> from step 40"]
    assert changes(0, 20, 30) == ["delayed update: off -> from step 31"]
    assert changes(20, 0, 30) == ["delayed update: from step 31 -> off"]


def test_fa4_runs_only_where_it_can(monkeypatch):
    """`auto` takes FlashAttention-4 where it can run (package, GPU), `sdpa` never; `fa4` by name is refused where it
    cannot run. No GPU here: where FA4 could run is stated through fa4_unavailable_reason."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the same answer on a GPU host
    model = _tiny_model()
    auto, sdpa, fa4 = SpeedConfig(), SpeedConfig(attention_kernel="sdpa"), SpeedConfig(attention_kernel="fa4")
    assert "GPU" in flash_attn4.fa4_unavailable_reason()
    assert not speed.use_fa4(cuda=True, model=model, speed=auto)
    monkeypatch.setattr(flash_attn4, "fa4_unavailable_reason", lambda: None)
    assert speed.use_fa4(cuda=True, model=model, speed=auto)
    assert not speed.use_fa4(cuda=False, model=model, speed=auto)
    assert not speed.use_fa4(cuda=True, model=model, speed=sdpa)
    assert speed.use_fa4(cuda=True, model=model, speed=fa4)
    monkeypatch.setattr(flash_attn4, "fa4_unavailable_reason", lambda: "flash-attn-4 is not importable (no module)")
    assert speed.fused_kernels_problem(auto, cuda=True) is None
    problem = speed.fused_kernels_problem(fa4, cuda=True)
    assert problem is not None and problem.setting == "--attention_kernel" and "not importable" in problem.message


def test_auto_attention_falls_back_to_sdpa_when_fa4_fails_its_probe(monkeypatch):
    """`auto` switches the model to FA4 only after the setup probe (a small forward and backward) succeeds; a failure
    leaves SDPA and says why. `fa4` by name skips the probe. The probe's own exception handling runs for real (a
    registration that raises); its GPU forward/backward cannot run here."""
    options = SpeedConfig(fused_kernels="off", compile="off")
    monkeypatch.setattr(flash_attn4, "fa4_unavailable_reason", lambda: None)
    monkeypatch.setattr(flash_attn4, "_register_fa4", lambda: None)

    def boom():
        raise RuntimeError("CuTe DSL: unsupported driver\nmore detail")

    with monkeypatch.context() as m:
        m.setattr(flash_attn4, "_register_fa4", boom)
        assert flash_attn4.fa4_probe_failure(_tiny_model()) == "RuntimeError: CuTe DSL: unsupported driver"

    logs, warnings = [], []
    monkeypatch.setattr(flash_attn4, "fa4_probe_failure", lambda model, documents=False: "RuntimeError: boom")
    model = _tiny_model()
    applied = speed.apply_speed_options(model, options, cuda=True, log=logs.append, warn=warnings.append)
    assert model.config._attn_implementation == "sdpa" and applied["attention_kernel"] == "sdpa"
    assert any("failed its setup probe (RuntimeError: boom); using SDPA" in line for line in warnings)  # every rank

    monkeypatch.setattr(flash_attn4, "fa4_probe_failure", lambda model, documents=False: None)
    model = _tiny_model()
    applied = speed.apply_speed_options(model, options, cuda=True, log=logs.append)
    assert model.config._attn_implementation == flash_attn4.FA4_NAME and applied["attention_kernel"] == "fa4"

    monkeypatch.setattr(flash_attn4, "fa4_probe_failure",
                        lambda model, documents=False: pytest.fail("fa4 by name is not probed"))
    model = _tiny_model()
    speed.apply_speed_options(model, SpeedConfig(fused_kernels="off", compile="off", attention_kernel="fa4"), cuda=True,
                              log=logs.append)
    assert model.config._attn_implementation == flash_attn4.FA4_NAME


def test_documents_without_fa4_take_the_variable_length_paths_on_a_gpu(monkeypatch):
    """Documents or packed examples where FlashAttention-4 is not in force: PyTorch's varlen where it runs, else SDPA
    once per document, no mask function registered (so transformers builds none); `sdpa` by name and models whose
    attention needs the mask keep transformers' mask, the log saying why. No GPU here: `cuda=True` stands for one, and
    whether varlen runs is set by hand (the kernels themselves are held equal in test_document_attention.py)."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    from model_utils.models import document_attention

    monkeypatch.setattr(flash_attn4, "fa4_unavailable_reason", lambda: "no Hopper here")
    options = SpeedConfig(fused_kernels="off", compile="off")
    for varlen_reason, kernel, name in ((None, "varlen", document_attention.VARLEN_NAME),
                                        ("an Ada-less T4", "sdpa-documents", document_attention.SDPA_DOCUMENTS_NAME)):
        monkeypatch.setattr(document_attention, "varlen_unavailable_reason", lambda reason=varlen_reason: reason)
        logs, model = [], _tiny_model()
        applied = speed.apply_speed_options(model, options, cuda=True, log=logs.append, documents=True, seq_len=64)
        assert applied["attention_kernel"] == kernel and model.config._attn_implementation == name
        assert document_attention.takes_document_boundaries(model)
        assert name not in ALL_MASK_ATTENTION_FUNCTIONS and any("within documents, no dense mask" in x for x in logs)
    for kept, cuda, documents, seq_len in ((SpeedConfig(fused_kernels="off", compile="off", attention_kernel="sdpa"),
                                            True, True, 64), (options, False, True, 64), (options, True, False, 64)):
        model = _tiny_model()
        applied = speed.apply_speed_options(model, kept, cuda=cuda, log=lambda _: None, documents=documents,
                                            seq_len=seq_len)
        assert applied["attention_kernel"] == "sdpa" and model.config._attn_implementation == "sdpa"
    logs, model = [], _tiny_model()
    model.config.sliding_window, model.config.layer_types = 32, ["sliding_attention"] * model.config.num_hidden_layers
    applied = speed.apply_speed_options(model, options, cuda=True, log=logs.append, documents=True, seq_len=64)
    assert applied["attention_kernel"] == "sdpa"
    assert any("transformers masks the documents for SDPA (its attention has a sliding window of 32" in x for x in logs)
    monkeypatch.setattr(document_attention, "varlen_unavailable_reason", lambda: "torch 2.9 has no varlen")
    monkeypatch.setattr(speed, "varlen_unavailable_reason", lambda: "torch 2.9 has no varlen")
    problem = speed.fused_kernels_problem(SpeedConfig(attention_kernel="varlen"), cuda=True)
    assert problem.setting == "--attention_kernel" and problem.value == "varlen" and "2.9" in problem.message


def test_compile_only_with_cuda_and_not_where_zero3_keeps_eager_layers():
    auto = SpeedConfig()
    assert speed.use_compile(cuda=True, zero3_eager=False, speed=auto)
    assert not speed.use_compile(cuda=False, zero3_eager=False, speed=auto)
    assert not speed.use_compile(cuda=True, zero3_eager=True, speed=auto)
    assert not speed.use_compile(cuda=True, zero3_eager=False, speed=SpeedConfig(compile="off"))
    assert not speed.zero3_keeps_eager_layers(3, offloaded=False, lora=False)
    assert speed.zero3_keeps_eager_layers(3, offloaded=True, lora=False)
    assert speed.zero3_keeps_eager_layers(3, offloaded=False, lora=True)
    assert not speed.zero3_keeps_eager_layers(2, offloaded=True, lora=True)


def _zero3_plan(monkeypatch, config: str, *flags: str, raw_edit=None, tmp_path=None, gpu_gib="139.8",
                model="qwen3-8b", world=4):
    from model_utils.planning import plan as plan_module

    monkeypatch.setenv("GPU_MEMORY_GIB", gpu_gib)
    monkeypatch.setattr(speed, "liger_available", lambda: True)
    path = REPO / "configs" / config
    if raw_edit:
        raw = json.loads(path.read_text())
        raw_edit(raw)
        path = tmp_path / config
        path.write_text(json.dumps(raw))
    cfg = parse_args(["--model", model, "--ds_config", str(path), "--global_batch_tokens", "262144",
                      "--dummy_data", "64", "--checkpoint_dir", "/nonexistent/ckpt", "--no-export", *flags])
    return plan_module.make_plan(cfg, world, decides=False)


def test_zero3_plans_compiled_layers_gathered_whole_with_the_next_one_prefetched(monkeypatch, tmp_path):
    """Qwen3-8B, configs/zero3.json, 4 GPUs: the layers compile, and the "auto" prefetch bucket holds one layer's
    parameters (Hugging Face's 0.9 h^2 where the layers stay eager: a single linear module's)."""
    hidden = 4096
    plan = _zero3_plan(monkeypatch, "zero3.json")
    assert plan.compiled_layers
    layer = plan.model.layer_params
    assert 200e6 < layer < 240e6  # Qwen3-8B: 4096 x (2 x 4096 + 2 x 1024) + 3 x 4096 x 12288, and its norms
    assert plan.ds_config["zero_optimization"]["stage3_prefetch_bucket_size"] == layer

    offloaded = _zero3_plan(monkeypatch, "zero3-offload.json")
    assert not offloaded.compiled_layers
    assert offloaded.ds_config["zero_optimization"]["stage3_prefetch_bucket_size"] == int(0.9 * hidden * hidden)

    def written(raw):
        raw["zero_optimization"]["stage3_prefetch_bucket_size"] = 50_000_000
    mine = _zero3_plan(monkeypatch, "zero3.json", raw_edit=written, tmp_path=tmp_path)
    assert mine.compiled_layers and mine.ds_config["zero_optimization"]["stage3_prefetch_bucket_size"] == 50_000_000

    assert not _zero3_plan(monkeypatch, "zero3.json", "--lora_rank", "16").compiled_layers

    eager = _zero3_plan(monkeypatch, "zero3.json", "--compile", "off")
    assert not eager.compiled_layers
    assert eager.ds_config["zero_optimization"]["stage3_prefetch_bucket_size"] == int(0.9 * hidden * hidden)
    # the compiled layers keep fewer activations: the estimate at the same micro-batch is lower
    micro = plan.batch.micro
    assert plan.memory_model.peak(plan.ds_config, micro) < eager.memory_model.peak(eager.ds_config, micro)


def test_fused_kernels_fall_back_without_liger(monkeypatch):
    monkeypatch.setattr(speed, "liger_available", lambda: False)
    assert not speed.use_fused_kernels("auto", cuda=True)
    assert speed.fused_kernels_problem(SpeedConfig(fused_kernels="on"), cuda=True) is not None
    assert speed.fused_kernels_problem(SpeedConfig(), cuda=True) is None


def test_a_gpu_run_without_liger_says_so(monkeypatch):
    monkeypatch.setattr(speed, "liger_available", lambda: False)
    messages = []
    applied = speed.apply_speed_options(_tiny_model(), SpeedConfig(compile="off", attention_kernel="sdpa"), cuda=True,
                                        log=messages.append)
    assert applied["fused_kernels"] == "off"
    assert any("liger-kernel is not installed" in m and ".[gpu]" in m for m in messages)


def test_all_levers_are_no_ops_on_cpu():
    """Every lever on, but no GPU: the model is left exactly as built, so CI runs the default code path."""
    import torch

    model = _tiny_model()
    forward = model.forward
    layer_calls = [layer._compiled_call_impl for layer in model.model.layers]
    messages = []
    applied = speed.apply_speed_options(model, SpeedConfig(fused_kernels="on", liger_kernels="all", compile="layers",
                                                          sdpa_backend="cudnn", attention_kernel="fa4"),
                                        cuda=False, log=messages.append)
    assert applied == {"fused_kernels": "off", "flce_chunk_budget": None, "compile": "off", "attention_kernel": "sdpa",
                       "sdpa_backend": "auto"}
    assert messages == [] and model.forward == forward
    assert [layer._compiled_call_impl for layer in model.model.layers] == layer_calls
    ids = torch.randint(0, 100, (1, 16))
    assert torch.isfinite(model(input_ids=ids, labels=ids).loss)


def test_auto_persistence_keeps_zero3_parameters_whole_where_they_fit(monkeypatch, tmp_path):
    """configs/zero3.json ("stage3_param_persistence_threshold": "auto"), Qwen3-8B on 4 GPUs at micro-batch 4: on a
    139.8 GiB GPU every parameter persists (the threshold is the largest parameter, the estimate holds the whole 16-bit
    model beside the partition); on a 79.2 GiB one they stay partitioned at Hugging Face's 10 x hidden. Offload, LoRA
    and a number the config writes keep them partitioned."""
    from model_utils.config import deepspeed as dsc
    from model_utils.models.memory import GIB

    whole = _zero3_plan(monkeypatch, "zero3.json", "--micro_batch_size", "4")
    largest = whole.model.largest_param
    assert largest == 151_936 * 4096  # the embedding (and the LM head)
    assert whole.ds_config["zero_optimization"]["stage3_param_persistence_threshold"] == largest
    assert whole.memory_model.keeps_whole_parameters(whole.ds_config)
    assert f'"auto" -> {largest:,} elements' in whole.parameters_choice
    assert "no layer is gathered" in whole.parameters_choice and not any("ZeRO-3" in note for note in whole.notes)
    partitioned_ds = dsc.with_whole_parameters(whole.ds_config, 40_960)
    assert not whole.memory_model.keeps_whole_parameters(partitioned_ds)
    added = whole.memory_model.peak(whole.ds_config, 4) - whole.memory_model.peak(partitioned_ds, 4)
    assert added == pytest.approx(2 * whole.model.num_params)  # the whole 16-bit model on each GPU

    small = _zero3_plan(monkeypatch, "zero3.json", "--micro_batch_size", "4", gpu_gib="79.2")
    assert small.ds_config["zero_optimization"]["stage3_param_persistence_threshold"] == 40_960
    assert small.parameters_choice.startswith("ZeRO-3 partitions the parameters")
    assert "90% of the GPU is 71.3" in small.parameters_choice

    offloaded = _zero3_plan(monkeypatch, "zero3-offload.json", "--micro_batch_size", "4")
    assert offloaded.ds_config["zero_optimization"]["stage3_param_persistence_threshold"] == 40_960
    lora = _zero3_plan(monkeypatch, "zero3.json", "--micro_batch_size", "4", "--lora_rank", "16")
    assert lora.ds_config["zero_optimization"]["stage3_param_persistence_threshold"] == 40_960

    def written(raw):
        raw["zero_optimization"]["stage3_param_persistence_threshold"] = 100_000
    mine = _zero3_plan(monkeypatch, "zero3.json", "--micro_batch_size", "4", raw_edit=written, tmp_path=tmp_path)
    assert mine.ds_config["zero_optimization"]["stage3_param_persistence_threshold"] == 100_000
    assert not any("ZeRO-3" in note and "persistence" in note for note in mine.notes) and mine.parameters_choice is None
    assert whole.memory.phases.peak[1] / GIB < 0.9 * 139.8


def test_auto_persistence_with_the_automatic_micro_batch(monkeypatch):
    """Whole parameters are kept where their largest fitting micro-batch is at least half the partitioned one's (on 4
    GPUs 2 with whole parameters ran as fast as 4 partitioned): Llama-7B-shaped on 4 H100s at 2 (2 partitioned too);
    Qwen3-8B at 512 tokens on 4 GPUs of 56 GiB: whole at 2, partitioned at 8, so partitioned."""
    h100 = _zero3_plan(monkeypatch, "zero3.json", model="llama-7b", gpu_gib="79.2")
    assert h100.batch.micro == 2 and h100.memory_model.keeps_whole_parameters(h100.ds_config)
    short = _zero3_plan(monkeypatch, "zero3.json", "--seq_len", "512", gpu_gib="56")
    assert short.batch.micro == 8 and not short.memory_model.keeps_whole_parameters(short.ds_config)
    assert short.parameters_choice.startswith("ZeRO-3 partitions the parameters")
    assert "micro-batch 2 against 8" in short.parameters_choice


def test_the_preflight_names_whole_parameters_or_zero2_where_they_fit_at_the_same_micro_batch(monkeypatch, tmp_path):
    """ZeRO-3 without offload, 4 GPUs, Qwen3-8B at micro-batch 4 with its parameters partitioned by the config's own
    threshold: where whole parameters fit the GPU (139.8 GiB) the preflight names "auto" persistence, with what crosses
    the GPUs per step; where only ZeRO-2 (without ZeRO-3's second copy of the partition) fits, ZeRO-2; where the run
    keeps them whole already, ZeRO-2 where it fits (the same data per step without ZeRO-3's hooks). The notes never
    change the config."""
    from model_utils.planning.preflight import check_plan

    def notes(plan, start):
        return [n for n in check_plan(plan, check_data=False, check_disk=False).notes if n.startswith(start)]

    def written(raw):
        raw["zero_optimization"]["stage3_param_persistence_threshold"] = 100_000
    large = _zero3_plan(monkeypatch, "zero3.json", "--micro_batch_size", "4", raw_edit=written, tmp_path=tmp_path)
    said = notes(large, "whole parameters fit")
    assert len(said) == 1 and "micro-batch 4" in said[0] and '"stage3_param_persistence_threshold": "auto"' in said[0]
    # what crosses the GPUs per step: ZeRO-3 gathers the 16-bit model twice per micro-batch and reduce-scatters its
    # gradients once; with whole parameters (as ZeRO-2) it reduce-scatters each micro-batch's gradients and gathers
    # the updated model once per step (3/4 of each on 4 GPUs)
    model = large.model.num_params * 2 * 3 / 4 / 2**30
    accumulation = large.batch.accumulation
    assert (f"~{(accumulation + 1) * model:.1f} GiB of weights and gradients per step instead of "
            f"~{3 * accumulation * model:.1f}") in said[0]
    assert large.ds_config["zero_optimization"]["stage3_param_persistence_threshold"] == 100_000
    assert not notes(large, "ZeRO-2 fits")

    between = _zero3_plan(monkeypatch, "zero3.json", "--micro_batch_size", "4", raw_edit=written, tmp_path=tmp_path,
                          gpu_gib="110")
    assert not notes(between, "whole parameters fit")
    said = notes(between, "ZeRO-2 fits")
    assert len(said) == 1 and '"stage": 2' in said[0] and between.ds_config["zero_optimization"]["stage"] == 3

    # whole parameters kept already: ZeRO-2 moves the same data without ZeRO-3's hooks on every module
    auto = _zero3_plan(monkeypatch, "zero3.json", "--micro_batch_size", "4")
    assert auto.memory_model.keeps_whole_parameters(auto.ds_config)
    assert not notes(auto, "whole parameters fit")
    said = notes(auto, "ZeRO-2 fits")
    assert len(said) == 1 and "hooks on every module" in said[0] and '"stage": 2' in said[0]
    assert auto.ds_config["zero_optimization"]["stage"] == 3
    assert not notes(_zero3_plan(monkeypatch, "zero3.json", "--micro_batch_size", "4", gpu_gib="79.2"), "ZeRO-2 fits")
    assert not notes(_zero3_plan(monkeypatch, "zero3-offload.json", "--micro_batch_size", "4"), "ZeRO-2 fits")


def test_the_preflight_says_zero3_partitions_nothing_on_one_gpu(monkeypatch):
    """One GPU, configs/zero3.json, llama-8b with LoRA at 65,536 tokens (adapters keep "auto" persistence partitioned):
    ZeRO-3 splits nothing over one GPU yet gathers every layer's parameters each pass (measured: 40.4 s a step against
    17.3 under ZeRO-2, docs/PERFORMANCE.md, Long sequences): ZeRO-2 is named, with that reason."""
    from model_utils.planning.preflight import check_plan

    plan = _zero3_plan(monkeypatch, "zero3.json", "--seq_len", "65536", "--micro_batch_size", "1",
                       "--gradient_checkpointing", "--lora_rank", "16", "--global_batch_tokens", "65536",
                       model="llama-8b", gpu_gib="79.2", world=1)
    assert not plan.memory_model.keeps_whole_parameters(plan.ds_config)
    said = [n for n in check_plan(plan, check_data=False, check_disk=False).notes if n.startswith("ZeRO-2 fits")]
    assert len(said) == 1 and "one GPU" in said[0] and "partitions nothing" in said[0] and '"stage": 2' in said[0]
    assert "ZeRO-3 on one GPU" in said[0]
    several = _zero3_plan(monkeypatch, "zero3.json", "--micro_batch_size", "4", gpu_gib="110")
    assert not any("partitions nothing" in n for n in check_plan(several, check_data=False, check_disk=False).notes)


@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "checkpointed"])
def test_compiled_layers_are_one_graph_with_the_recomputation_outside_it(checkpointed):
    """The decoder layers compiled as the trainer compiles them (models.speed.compiled_layer_class; Dynamo's
    aot_eager backend here, so that no C++ is built: what is captured is the same): one graph for every layer, no
    graph break, and with --gradient_checkpointing each layer's compiled forward runs again in the backward pass (the
    recomputation wraps the graph, as transformers checkpoints the layer); the loss and gradients are the eager
    model's. Compiling transformers' checkpointed forward itself (transformers 5.25) broke the graph at the
    recomputation and ran every layer eagerly. About 5 s: the process's first Dynamo compile."""
    import functools

    import torch
    from torch._dynamo.utils import counters

    from model_utils.data.tokenizer import load_tokenizer
    from model_utils.models.build import build_model, model_config

    def build():
        torch.manual_seed(0)
        return build_model("tiny", model_config("tiny", load_tokenizer(None)), torch.float32, "sdpa", checkpointed)

    eager, model = build(), build()
    calls = []

    def counted_compile(function):
        compiled = torch.compile(function, backend="aot_eager")

        @functools.wraps(function)
        def counted(*args, **kwargs):
            calls.append(1)
            return compiled(*args, **kwargs)
        return counted

    torch._dynamo.reset()
    counters.clear()
    layers = model.model.layers
    compiled_class = speed.compiled_layer_class(type(layers[0]), counted_compile)
    for layer in layers:
        layer.__class__ = compiled_class
    ids = torch.randint(0, 1000, (2, 32), generator=torch.Generator().manual_seed(1))
    losses = []
    for m in (eager, model):
        m.train()
        loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.item())
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"], dict(counters["graph_break"])
    assert len(calls) == len(layers) * (2 if checkpointed else 1)
    assert losses[1] == pytest.approx(losses[0], rel=1e-6)
    for (name, p), q in zip(eager.named_parameters(), model.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-7), name
