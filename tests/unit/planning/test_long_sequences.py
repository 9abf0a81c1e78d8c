"""The preflight on long sequences (planning/memory_checks.py): the longest sequence a setup fits, the split that fits a
requested length, and the host memory of the offloaded layer inputs. The GPU's size comes through GPU_MEMORY_GIB (no
GPU here) and Liger counts as installed on the GPU nodes; nothing else is stood in for."""

from __future__ import annotations

import dataclasses

import pytest

from model_utils.config.flags import parse_args
from model_utils.models.memory import GIB, offloaded_activation_bytes
from model_utils.planning.report import Report


def _plan(monkeypatch, world, *flags, host_gib=None):
    from model_utils.models import speed
    from model_utils.planning import plan as plan_module

    monkeypatch.setenv("GPU_MEMORY_GIB", "80")
    monkeypatch.setattr(speed, "liger_available", lambda: True)
    cfg = parse_args(["--model", "llama-1b", "--micro_batch_size", "1", "--dummy_data", "64", "--gradient_checkpointing",
                      "--checkpoint_dir", "/nonexistent/ckpt", "--no-export", *flags])
    plan = plan_module.make_plan(cfg, world, decides=False)
    if host_gib is not None:  # a GPU node's free memory, as its own start measures it
        plan = dataclasses.replace(plan, hardware=dataclasses.replace(plan.hardware, host_available=host_gib * GIB))
    return plan


def test_the_longest_sequence_grows_with_the_split_and_fits_the_estimate(monkeypatch, session_cache):
    from model_utils.planning.memory_checks import longest_sequence, note_long_sequences

    plan = _plan(monkeypatch, 4, "--seq_len", "262144", "--sequence_parallel", "2", "--rope_scaling", "yarn:4")
    layers = plan.memory.checkpointed_layers
    one, two, four = (longest_sequence(plan, n) for n in (1, 2, 4))
    assert 0 < one < two < four and two % 2048 == 0
    budget = plan.memory_model.budget
    at = lambda tokens, n: dataclasses.replace(plan.memory_model, seq_len=tokens // n).phases(  # noqa: E731
        plan.ds_config, 1, layers).train
    assert at(two, 2) <= budget < at(two + 2048, 2)  # the longest: one step of 1,024 tokens per GPU more does not fit
    report = Report(plan)
    note_long_sequences(plan, report)
    assert f"the longest that fits is ~{two:,} tokens per sequence" in report.estimates[-1]
    assert "--sequence_parallel 2, --gradient_checkpointing" in report.estimates[-1]


def test_with_offloaded_inputs_the_longest_sequence_fits_the_nodes_free_host_memory(monkeypatch, session_cache):
    """--offload_activations on one 80 GiB GPU (llama-1b: 16 layers, 4 KiB of input per token): the GPU alone would
    take far more than 262,144 tokens, but 20 GiB of free host memory (90% of it for the offload: HOST_MEMORY_SHARE)
    hold the 16 layers' inputs and the 6 tensors of their size after the layers (compiled layers: PyTorch's final
    norm) of 214,016 tokens, each in a buffer of its exact size (models/offload.py), and not 1,024 tokens more; with
    Liger's final norm (eager layers), 2 after the layers; 1,000 GiB leave the GPU as the limit. Inputs below
    OFFLOAD_EXACT_BYTES go to PyTorch's pinned allocator, which rounds each up to a power of two. The preflight's line
    names the host memory it counted."""
    from model_utils.models.memory import OFFLOAD_EXACT_BYTES, pinned_bytes
    from model_utils.planning.memory_checks import HOST_MEMORY_SHARE, longest_sequence, note_long_sequences

    assert [pinned_bytes(n) for n in (0, 1, 3 * 2**30, 2**31)] == [0, 1, 2**32, 2**31]
    flags = ("--seq_len", "262144", "--rope_scaling", "yarn:8", "--offload_activations")
    plenty, tight = _plan(monkeypatch, 1, *flags, host_gib=1000), _plan(monkeypatch, 1, *flags, host_gib=20)
    longest = longest_sequence(tight, 1)
    assert tight.torch_final_norm and longest == 214016 < longest_sequence(plenty, 1)
    config, room = tight.model.config, HOST_MEMORY_SHARE * 20 * GIB
    assert (16 + 6) * longest * 4096 == offloaded_activation_bytes(config, longest, 1, 16, True, True) <= room
    assert offloaded_activation_bytes(config, longest + 1024, 1, 16, True, True) > room
    assert offloaded_activation_bytes(config, longest, 1, 16, True, False) == (16 + 2) * longest * 4096
    small = 6144 * 4096  # 24 MiB a tensor: below the exact buffers' size, rounded to 32 MiB
    assert small < OFFLOAD_EXACT_BYTES and offloaded_activation_bytes(config, 6144, 1, 16, True) == 18 * 32 * 2**20
    eager = _plan(monkeypatch, 1, *flags, "--compile", "off", host_gib=20)
    assert not eager.torch_final_norm and longest_sequence(eager, 1) > longest
    report = Report(tight)
    note_long_sequences(tight, report)
    assert "the longest that fits is ~214,016 tokens" in report.estimates[-1]
    assert "80 GiB GPUs, 20 GiB of host memory free, by the estimate" in report.estimates[-1]


def test_a_sequence_that_does_not_fit_gets_the_split_that_fits(monkeypatch, session_cache):
    from model_utils.planning.memory_checks import check_memory, longest_sequence, split_that_fits

    # 100 GiB of free host memory: too little for the inputs of 4 ranks offloaded (~256 GiB), the other fix
    plan = _plan(monkeypatch, 4, "--seq_len", "1048576", "--rope_scaling", "yarn:8", host_gib=100)
    assert longest_sequence(plan, 1) < 1048576
    split = split_that_fits(plan)
    assert split in (2, 4) and longest_sequence(plan, split) >= 1048576
    report = Report(plan)
    check_memory(plan, report)
    assert len(report.problems) == 1
    assert report.problems[0].fix.startswith(f"split each sequence across {split} GPUs: --sequence_parallel {split}")


def test_a_sequence_that_fits_with_its_inputs_offloaded_gets_that_fix(monkeypatch, session_cache):
    """655,360 tokens of llama-1b on one 80 GiB GPU: too much with the layers' inputs on the GPU; with them in host
    memory (55 GiB: 16 inputs and 6 tensors of their size after the layers) it fits, and the fix says so first, with the host memory it takes; where the node has 20 GiB free,
    it does not offer it."""
    from model_utils.planning.memory_checks import check_memory

    flags = ("--seq_len", "655360", "--rope_scaling", "yarn:8")
    for host_gib, offered in ((1000, True), (20, False)):
        report = Report(_plan(monkeypatch, 1, *flags, host_gib=host_gib))
        check_memory(report.plan, report)
        assert [p.setting for p in report.problems] == ["train_micro_batch_size_per_gpu / zero_optimization"]
        assert report.problems[0].fix.startswith("keep the recomputed layers' inputs in host memory: "
                                                 "--offload_activations (~55 GiB of host memory per node") == offered


def test_offloaded_layer_inputs_count_in_the_nodes_host_memory(monkeypatch, session_cache):
    from model_utils.planning.memory_checks import check_host_memory

    flags = ("--seq_len", "262144", "--rope_scaling", "yarn:2", "--offload_activations")
    plan = _plan(monkeypatch, 2, *flags, host_gib=1000)
    config = plan.model.config
    # 2 ranks, each 16 layers' inputs and 6 tensors of their size after them: compiled layers beside Liger's loss
    # alone leave the final norm to PyTorch's RMSNorm, whose fp32 and 16-bit copies count 5 of them
    assert plan.torch_final_norm
    want = 2 * offloaded_activation_bytes(config, 262144, 1, config.num_hidden_layers, True, True)
    assert plan.memory.activation_host_bytes == pytest.approx(want) == pytest.approx(2 * (16 + 6) * 262144 * 2048 * 2)
    kept = _plan(monkeypatch, 2, "--seq_len", "262144", "--rope_scaling", "yarn:2", host_gib=1000)
    assert kept.memory.activation_host_bytes == 0
    assert plan.memory.phases.train == pytest.approx(kept.memory.phases.train - 16 * 262144 * 2048 * 2)
    report = Report(plan)
    check_host_memory(plan, report)
    assert not report.problems and "offloaded layer inputs of 2 rank(s)" in report.estimates[0]
    small = _plan(monkeypatch, 2, *flags, host_gib=20)  # 44 GiB of inputs do not fit a node with 20 GiB free
    report = Report(small)
    check_host_memory(small, report)
    assert [p.setting for p in report.problems] == ["--offload_activations"]
    assert "--sequence_parallel" in report.problems[0].fix


# Peaks measured on H200s at micro-batch 1 (docs/PERFORMANCE.md, Long sequences;
# benchmarks/results/h200x2-2026-11-28-long-context.jsonl unless noted): model, GPUs, flags, peak GiB. The runs from 32,768
# tokens per GPU tiled their MLPs (the --tiled_mlp auto of then, which tiled wherever a GPU held that many).
TILED = ("--tiled_mlp", "on")
MEASURED_AT_LENGTH = [
    ("qwen3-0.6b", 2, ("--seq_len", "16384", "--sequence_parallel", "2"), 14.1),
    ("llama-1b", 2, (*TILED, "--seq_len", "131072", "--sequence_parallel", "2", "--gradient_checkpointing"), 17.6),
    ("llama-1b", 1, (*TILED, "--seq_len", "131072", "--gradient_checkpointing"), 32.3),
    ("llama-1b", 1, (*TILED, "--seq_len", "131072", "--gradient_checkpointing", "--compile", "off"), 31.8),
    ("llama-1b", 1, (*TILED, "--seq_len", "131072", "--gradient_checkpointing", "--offload_activations"), 26.3),
    ("llama-1b", 2, (*TILED, "--seq_len", "262144", "--sequence_parallel", "2", "--gradient_checkpointing", "--compile",
                     "off", "--offload_activations"), 18.7),
    # benchmarks/results/h200x4-2026-11-28-long-context.jsonl: Llama 3.1 8B's shape on one GPU, parameters and
    # optimizer offloaded, and on two splitting each sequence (whole parameters on each)
    ("llama-8b", 1, (*TILED, "--seq_len", "262144", "--gradient_checkpointing", "--compile", "off", "--ds_config",
                     "configs/zero3-offload.json"), 87.8),
    ("llama-8b", 2, (*TILED, "--seq_len", "262144", "--sequence_parallel", "2", "--gradient_checkpointing",
                     "--ds_config", "configs/zero3.json"), 120.8),
    # h200x2-2026-11-28-long-context.jsonl, call 2: the same split at 65,536 and 131,072 tokens, --tiled_mlp auto
    # leaving the MLPs whole (the step fits without tiles)
    ("llama-8b", 2, ("--seq_len", "65536", "--sequence_parallel", "2", "--gradient_checkpointing", "--ds_config",
                     "configs/zero3.json"), 89.6),
    ("llama-8b", 2, ("--seq_len", "131072", "--sequence_parallel", "2", "--gradient_checkpointing", "--ds_config",
                     "configs/zero3.json"), 104.2),
    # h200x2-2026-11-28-long-context-lora.jsonl: llama-8b LoRA rank 16 on one GPU, the MLPs whole, compiled layers
    # (their backward recomputes the adapters' dropped copies and masks)
    ("llama-8b", 1, ("--seq_len", "262144", "--gradient_checkpointing", "--offload_activations", "--lora_rank", "16",
                     "--tiled_mlp", "off"), 101.7),
]
# LoRA rank 16 at 262,144 tokens on one GPU, the inputs offloaded: the estimate lies above these peaks, by a fifth
# and more; the preflight errs on the side that never admits a step that does not fit (model, flags, peak GiB;
# h200x2-2026-11-28-long-context-lora.jsonl and h200-2026-11-29-long-context-one-gpu.jsonl).
LORA_FLAGS = ("--seq_len", "262144", "--gradient_checkpointing", "--offload_activations", "--lora_rank", "16")
MEASURED_BELOW_THE_ESTIMATE = [
    ("llama-8b", (*LORA_FLAGS, "--tiled_mlp", "off", "--compile", "off"), 84.7),
    ("llama-8b", (*LORA_FLAGS, *TILED, "--compile", "off"), 49.2),  # on an H100's 79.2 GiB
    ("llama-8b", (*LORA_FLAGS, *TILED), 51.2),
]


def _train_estimate_gib(monkeypatch, model, world, flags, gpu_gib, chunks_as_then=True) -> float:
    """The estimated training peak of a measured run at micro-batch 1 on GPUs of `gpu_gib` (yarn:2 for Llamas).
    `chunks_as_then`: the fused loss's chunks as those runs had them, at --flce_chunk_budget whatever the length (the
    budget is lowered at long sequences since: liger.chunk_budget_in_force)."""
    from model_utils.models import speed
    from model_utils.patches import liger
    from model_utils.planning import plan as plan_module

    monkeypatch.setenv("GPU_MEMORY_GIB", str(gpu_gib))
    monkeypatch.setattr(speed, "liger_available", lambda: True)
    if chunks_as_then:
        monkeypatch.setattr(liger, "FLCE_LOGITS_BYTES", 1 << 62)
    rope = ("--rope_scaling", "yarn:2") if model.startswith("llama") and "--rope_scaling" not in flags else ()
    cfg = parse_args(["--model", model, "--micro_batch_size", "1", "--dummy_data", "64", "--checkpoint_dir",
                      "/nonexistent/ckpt", "--no-export", *rope, *flags])
    return plan_module.make_plan(cfg, world, decides=False).memory.phases.train / GIB


@pytest.mark.parametrize("model, world, flags, peak_gib", MEASURED_AT_LENGTH)
def test_the_estimate_at_length_is_within_a_tenth_of_the_measured_peak(monkeypatch, session_cache, model, world, flags,
                                                                       peak_gib):
    assert _train_estimate_gib(monkeypatch, model, world, flags, 139) == pytest.approx(peak_gib, rel=0.10)


@pytest.mark.parametrize("tokens, yarn, peak_gib", [(360448, 3, 61.7), (401408, 4, 66.9)])
def test_the_estimate_on_an_h100s_memory_is_the_measured_peak_and_host_memory(monkeypatch, session_cache, tokens,
                                                                             yarn, peak_gib):
    """h200-2026-11-29-long-context-one-gpu.jsonl (sessions 3 and 4): llama-8b LoRA rank 16, eager layers, MLPs tiled,
    inputs offloaded, on one GPU held to 79.2 GiB, with the fused loss's chunks bounded (budget 1 at these lengths)
    and the offloaded tensors in exact-size buffers: 61.7 GiB peak at 360,448 tokens (the estimate 62.6) and 66.9 at
    401,408 (67.2); host buffers 93.5 and 104.1 GiB, 34 each (the 32 layers' inputs and 2 after them: Liger's final
    norm beside eager layers)."""
    from model_utils.planning import plan as plan_module

    flags = (*LORA_FLAGS[2:], "--seq_len", str(tokens), "--rope_scaling", f"yarn:{yarn}", *TILED, "--compile", "off")
    assert _train_estimate_gib(monkeypatch, "llama-8b", 1, flags, 79.2, chunks_as_then=False) == pytest.approx(
        peak_gib, rel=0.02)
    cfg = parse_args(["--model", "llama-8b", "--micro_batch_size", "1", "--dummy_data", "64", "--checkpoint_dir",
                      "/nonexistent/ckpt", "--no-export", *flags])
    plan = plan_module.make_plan(cfg, 1, decides=False)
    assert plan.memory.activation_host_bytes == 34 * tokens * 4096 * 2


@pytest.mark.parametrize("model, flags, peak_gib", MEASURED_BELOW_THE_ESTIMATE)
def test_the_lora_estimate_at_length_is_never_below_the_measured_peak(monkeypatch, session_cache, model, flags,
                                                                       peak_gib):
    assert peak_gib <= _train_estimate_gib(monkeypatch, model, 1, flags, 79.2) <= 1.35 * peak_gib


def test_tiled_mlps_auto_tiles_only_where_the_step_would_not_fit_without_them(monkeypatch, session_cache):
    """--tiled_mlp auto on llama-1b (80 GiB GPUs): below 32,768 tokens per GPU never; at 65,536 tokens on one GPU
    the step fits untiled, so the MLPs stay whole (inside the compiled layer, no recomputation of their own: the
    8B pair at 65,536 tokens on 2 H200s measured the peer faster than a tiled run); at 917,504 (inputs offloaded) only tiles fit; "on"
    tiles wherever asked. The estimate follows the choice."""
    budget = 0.9 * 80 * GIB
    assert not _plan(monkeypatch, 1, "--seq_len", "16384").memory.tiled_mlp
    whole = _plan(monkeypatch, 1, "--seq_len", "65536")
    forced = _plan(monkeypatch, 1, "--seq_len", "65536", "--tiled_mlp", "on")
    assert not whole.memory.tiled_mlp and forced.memory.tiled_mlp
    assert forced.memory.phases.train < whole.memory.phases.train <= budget
    longest = _plan(monkeypatch, 1, "--seq_len", "917504", "--offload_activations")
    assert longest.memory.tiled_mlp and longest.memory.phases.train <= budget
    lora = _plan(monkeypatch, 1, "--seq_len", "65536", "--lora_rank", "16")  # LoRA keeps them (its estimate at length)
    assert lora.memory.tiled_mlp


def test_tiled_mlps_keep_one_tile_of_the_mlp_instead_of_the_sequence(monkeypatch, session_cache):
    from model_utils.models.memory import activation_bytes, evaluation_bytes, mlp_bytes_per_token, tiled_mlp_bytes

    config = _plan(monkeypatch, 1, "--seq_len", "65536").model.config
    for compiled in (True, False):
        args = (config, 65536, 1, True, True, True, 8, compiled)
        whole, tiled = activation_bytes(*args), activation_bytes(*args, tiled_mlp=True)
        # one layer's working set is in the peak (every layer recomputes): its MLP share of 65,536 tokens goes, one
        # tile's (2,048 tokens, values and gradients) comes
        assert whole - tiled == pytest.approx(65536 * mlp_bytes_per_token(config, compiled)
                                              - tiled_mlp_bytes(config, 1, 65536, compiled))
        assert tiled_mlp_bytes(config, 1, 65536, compiled) == 2 * 2048 * mlp_bytes_per_token(config, compiled)
    # evaluation's forward keeps one layer's working set: with tiles, its MLP's for 2,048 tokens
    mlp = mlp_bytes_per_token(config, True)
    assert (evaluation_bytes(config, 65536, 1, True) - evaluation_bytes(config, 65536, 1, True, tiled_mlp=True)
            == pytest.approx((65536 - 2048) * mlp))


def test_a_tiled_mlp_keeps_its_lora_adapters_for_one_tile_too(monkeypatch, session_cache):
    """LoRA's gate, up and down adapters run inside the MLP that --tiled_mlp recomputes tile by tile: tiled, the layer's
    working set counts the attention's adapters per token (q, k, v, o) and the MLP's for one tile, eager and compiled;
    so does what a compiled layer's backward recomputes of them (the dropped copies and masks, 3 bytes per element)."""
    from model_utils.models.memory import activation_bytes, mlp_bytes_per_token, tiled_mlp_bytes

    plan = _plan(monkeypatch, 1, "--seq_len", "65536", "--lora_rank", "16")
    config, adapters = plan.model.config, plan.model.adapters
    h, inter = config.hidden_size, config.intermediate_size
    assert (adapters.inputs, adapters.mlp_inputs, adapters.ranks, adapters.mlp_ranks) == (
        6 * h + inter, 2 * h + inter, 7 * 16, 3 * 16)
    for compiled, per_input, recomputed in ((True, 1, 3), (False, 4, 0)):
        mlp_adapters = per_input * (2 * h + inter) + 4 * 3 * 16
        assert adapters.backward_bytes_per_token(compiled) - adapters.backward_bytes_per_token(compiled, True) == (
            recomputed * (2 * h + inter))
        assert adapters.mlp_bytes_per_token(compiled) == mlp_adapters
        assert adapters.bytes_per_token(compiled, tiled_mlp=True) == adapters.bytes_per_token(compiled) - mlp_adapters
        args = (config, 65536, 1, True, True, True, 8, compiled)
        whole = activation_bytes(*args, adapters=adapters)
        tiled = activation_bytes(*args, adapters=adapters, tiled_mlp=True)
        tile = 2 * min(65536, h)  # tokens of one tile, values and gradients
        assert whole - tiled == pytest.approx((65536 - tile) * (mlp_bytes_per_token(config, compiled) + mlp_adapters)
                                              + 65536 * recomputed * (2 * h + inter))
        assert tiled_mlp_bytes(config, 1, 65536, compiled, adapters=adapters) == pytest.approx(
            tile * (mlp_bytes_per_token(config, compiled) + mlp_adapters))


def test_a_sequence_no_split_of_this_node_fits_gets_the_node_size_that_would(monkeypatch, session_cache):
    """llama-8b LoRA with its inputs offloaded at 524,288 tokens on a one-GPU node of 80 GiB: no split exists here, so
    the fix names the fewest GPUs of a larger node that fit it and the host memory their offloaded inputs take there;
    at 262,144 the same node needs none of it."""
    from model_utils.models import speed
    from model_utils.planning import plan as plan_module
    from model_utils.planning.memory_checks import check_memory, longest_sequence, split_on_a_larger_node

    monkeypatch.setenv("GPU_MEMORY_GIB", "79.2")
    monkeypatch.setattr(speed, "liger_available", lambda: True)

    def plan(seq_len):
        cfg = parse_args(["--model", "llama-8b", "--micro_batch_size", "1", "--dummy_data", "8", "--seq_len",
                          str(seq_len), "--rope_scaling", "yarn:4", "--gradient_checkpointing", "--lora_rank", "16",
                          "--offload_activations", "--checkpoint_dir", "/nonexistent/ckpt", "--no-export"])
        made = plan_module.make_plan(cfg, 1, decides=False)
        return dataclasses.replace(made, hardware=dataclasses.replace(made.hardware, host_available=1000 * GIB))

    long = plan(524288)
    n, host = split_on_a_larger_node(long)
    layers = long.memory.checkpointed_layers
    assert n in (2, 4, 8) and longest_sequence(long, 1) < 524288
    fits = lambda gpus: dataclasses.replace(long.memory_model, seq_len=524288 // gpus).phases(  # noqa: E731
        long.ds_config, 1, layers).train <= long.memory_model.budget
    assert fits(n) and (n == 2 or not fits(n // 2))
    assert host == n * offloaded_activation_bytes(long.model.config, 524288 // n, 1, layers, True, long.torch_final_norm)
    report = Report(long)
    check_memory(long, report)
    assert [p.setting for p in report.problems] == ["train_micro_batch_size_per_gpu / zero_optimization"]
    assert report.problems[0].fix.startswith(
        f"on a node of {n} GPUs, split each sequence across them: --sequence_parallel {n} (~{host / GIB:.0f} GiB of "
        "host memory for the offloaded inputs, by the estimate); or ")
    report = Report(plan(262144))
    check_memory(report.plan, report)
    assert report.problems == []


def test_a_sequence_past_the_positions_gets_the_rope_factor_counted_from_the_models_own(monkeypatch, session_cache):
    """llama-1b has 131,072 positions: 360,448 tokens need yarn:3, also where --rope_scaling yarn:2 already scaled them
    to 262,144 (the fix once divided by the scaled positions and proposed yarn:2 again)."""
    from model_utils.planning.preflight import check_plan

    for flags in ((), ("--rope_scaling", "yarn:2")):
        report = check_plan(_plan(monkeypatch, 1, "--seq_len", "360448", *flags), check_data=False, check_disk=False)
        (problem,) = [p for p in report.problems if p.setting == "--seq_len"]
        assert problem.fix.endswith("or scale its rotary embeddings: --rope_scaling yarn:3")
    assert problem.message == "exceeds the model's max_position_embeddings (262144 with --rope_scaling yarn:2)"
