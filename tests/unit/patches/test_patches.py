"""The library patches (model_utils/patches): each is gated on the versions it was tested with and names the tests
that show it behaves as the library's own path; outside its versions the stock path runs and the log says why. The
GPU-only parts (Liger's Triton kernels, FlashAttention-4's CuTe kernels) are stand-ins here with the real contract;
the ZeRO step's patches run for real in tests/distributed/test_zero_step_patch.py."""

from __future__ import annotations

import inspect
import re
import sys
import types
from pathlib import Path

import pytest

from model_utils import patches
from model_utils.patches import deepspeed_zero, flash_attn4, gate, liger, registry, torch_compile, within

TESTS = Path(__file__).resolve().parents[2]


def test_every_patch_names_tests_that_exist():
    records = registry.all_patches()
    assert set(records) == {"deepspeed_zero.NORM_OVERFLOW_CHECK", "deepspeed_zero.DEVICE_OVERFLOW_SKIP",
                            "deepspeed_offload.DELAYED_UPDATE", "deepspeed_offload.DELAYED_UPDATE_ZERO3",
                            "deepspeed_zero3.PARTIAL_OFFLOAD_STATE", "flash_attn4.FA4_KERNELS",
                            "deepspeed_checkpoint.SEQUENCE_PARALLEL_UNIVERSAL",
                            "liger.FLCE_CHUNK_BUDGET", "torch_compile.COMPILE_SETTINGS",
                            "bitsandbytes_cpu.TRAINING_LAYOUT"}
    for name, patch in records.items():
        assert patch.gain and patch.replaces and patch.tests, name
        assert within(patch.newest, patch.oldest, patch.newest), name
        for test in patch.tests:
            path, _, function = test.partition("::")
            source = (TESTS.parent / path).read_text()
            assert re.search(rf"^def {function}\(", source, re.M), f"{name}: {test} does not exist"


@pytest.mark.parametrize("version, inside", [("0.19.6", True), ("0.19.8", True), ("0.19.5", False),
                                             ("0.19.9", False), ("0.18.0", False), ("0.20.0rc1", False)])
def test_deepspeed_range(version, inside):
    patch = deepspeed_zero.NORM_OVERFLOW_CHECK
    assert within(version, patch.oldest, patch.newest) is inside


def test_pre_releases_local_versions_and_minor_ranges():
    fa4 = flash_attn4.FA4_KERNELS
    assert within("4.0.0b36", fa4.oldest, fa4.newest)
    assert not within("4.0.0b37", fa4.oldest, fa4.newest)
    assert not within("4.0.0", fa4.oldest, fa4.newest)
    assert within("2.11.0+cu130", "2.11", "2.13") and not within("2.10.1", "2.11", "2.13")
    assert within("2.11.3", "2.11", "2.11") and not within("2.12.0", "2.11", "2.11")  # a minor release's patches


def test_outside_the_range_the_gate_closes_and_says_so(monkeypatch):
    said = []
    monkeypatch.setattr(patches, "installed", lambda name: {"deepspeed": "0.18.0"}.get(name))
    assert gate(deepspeed_zero.NORM_OVERFLOW_CHECK, said.append) is False
    assert "deepspeed 0.18.0 is outside 0.19.6-0.19.8" in said[0] and "own path" in said[0]
    assert gate(liger.FLCE_CHUNK_BUDGET, said.append) is False and "liger-kernel not installed" in said[1]


def test_the_run_header_says_which_patches_are_in_force(monkeypatch):
    """Each patch is named once: among those whose tested versions are installed, or among those taking the library's
    own path with the version found (a newer release than tested, or none)."""
    versions = {"deepspeed": "0.19.8", "torch": "2.14.1", "liger-kernel": "0.8.5"}
    monkeypatch.setattr(patches, "installed", lambda name: versions.get(name))
    line = registry.versions_line()
    in_force, stock = line.split("; the library's own path: ")
    assert "deepspeed_zero.NORM_OVERFLOW_CHECK" in in_force and "liger.FLCE_CHUNK_BUDGET" in in_force
    assert "torch_compile.COMPILE_SETTINGS (torch 2.14.1, tested 2.11-2.11)" in stock
    assert "flash_attn4.FA4_KERNELS (flash-attn-4 not installed" in stock
    assert all(len(re.findall(rf"{re.escape(name)}\b", line)) == 1 for name in registry.all_patches())


def test_an_untested_deepspeed_takes_its_own_zero_step(monkeypatch):
    """The ZeRO-1/2 step is left exactly as DeepSpeed wrote it: nothing of the optimizer is replaced."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    class Engine:
        optimizer = DeepSpeedZeroOptimizer.__new__(DeepSpeedZeroOptimizer)

    said = []
    monkeypatch.setattr(patches, "installed", lambda name: "0.20.0")
    assert deepspeed_zero.streamline_zero_step(Engine(), "auto", said.append) == "scan"
    assert vars(Engine.optimizer) == {} and "outside 0.19.6-0.19.8" in said[0]


def test_compile_settings_raise_limits_and_set_the_budget(monkeypatch):
    """On the tested torch the limits cover every layer and the budget is set; on another torch nothing is touched."""
    import torch

    for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit", "accumulated_cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            monkeypatch.setattr(torch._dynamo.config, name, 8)
    monkeypatch.setattr(torch._functorch.config, "activation_memory_budget", 1.0)
    said = []
    monkeypatch.setattr(patches, "installed", lambda name: "2.12.0")
    assert torch_compile.configure(28, 0.9, said.append) is False
    assert torch._dynamo.config.recompile_limit == 8 and torch._functorch.config.activation_memory_budget == 1.0
    assert "torch 2.12.0 is outside 2.11-2.11" in said[0]
    monkeypatch.setattr(patches, "installed", lambda name: "2.11.0+cu130")
    assert torch_compile.configure(28, 0.9, said.append) is True
    assert torch._dynamo.config.recompile_limit == 4 * 28 + 8
    assert torch._functorch.config.activation_memory_budget == 0.9


def test_flce_chunk_budget_becomes_the_default_of_ligers_loss_function(monkeypatch):
    """Liger's Triton kernels cannot be imported without a GPU toolchain here, so its `functional` module is a
    stand-in with the real function's signature; what is tested is the project's wrapper: the default it injects, an
    explicit value still winning, the signature Liger's loss inspects to filter its kwargs, and the gate."""
    seen = []

    def liger_fused_linear_cross_entropy(input, weight, target, bias=None, reduction="mean", chunk_mem_const=1):
        seen.append(chunk_mem_const)
        return 0.0

    functional = types.ModuleType("liger_kernel.transformers.functional")
    functional.liger_fused_linear_cross_entropy = liger_fused_linear_cross_entropy
    package = types.ModuleType("liger_kernel.transformers")
    package.functional = functional
    monkeypatch.setitem(sys.modules, "liger_kernel", types.ModuleType("liger_kernel"))
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", package)
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers.functional", functional)
    monkeypatch.setattr(patches, "installed", lambda name: "0.8.5")
    liger._original.cache_clear()
    try:
        assert liger.set_flce_chunk_budget(8, log=lambda m: None)
        wrapped = functional.liger_fused_linear_cross_entropy
        wrapped(1, 2, 3)
        wrapped(1, 2, 3, chunk_mem_const=2)
        assert seen == [8, 2]
        assert "chunk_mem_const" in inspect.signature(wrapped).parameters
        liger.set_flce_chunk_budget(4, log=lambda m: None)  # applied twice: wraps the original, not the wrapper
        functional.liger_fused_linear_cross_entropy(1, 2, 3)
        assert seen[-1] == 4
        monkeypatch.setattr(patches, "installed", lambda name: "0.9.0")
        functional.liger_fused_linear_cross_entropy = liger_fused_linear_cross_entropy
        assert not liger.set_flce_chunk_budget(8, log=lambda m: None)  # untested: Liger's own chunking
        assert functional.liger_fused_linear_cross_entropy is liger_fused_linear_cross_entropy
    finally:
        liger._original.cache_clear()


class _Attention:
    is_causal = True


# bf16 results of two attention paths: each output rounded to bf16 (a relative step of up to 2**-7), so up to two
# roundings apart; with torch 2.13 and transformers 5.23, SDPA's output is one step from the stand-in's where
# |outputs| reach 2-4 (a step of 0.0156).
BF16_PATHS = dict(atol=1e-2, rtol=2**-6)



def test_the_fused_losss_chunk_budget_is_lowered_where_its_logits_would_pass_4_gib():
    """Liger 0.8.5 cuts BT tokens into chunks of next_power_of_2(ceil(BT / ceil(V / (budget x H)))) tokens: Llama 3.1 8B
    (H 4,096, V 128,256) at the default budget 8 would hold 65,536 tokens' logits (15.7 GiB) at 262,144 tokens a
    micro-batch, 2 holds 16,384 tokens' (3.9 GiB). Over lengths in steps of 4,096 tokens for three widths and
    vocabularies, the budget in force is the largest whose logits stay within 4 GiB, or 1, Liger's smallest (past
    524,288 tokens of Llama 3.1 8B its logits are 7.8 GiB). Fine-tuning's 16 x 2,048 tokens keep the budget asked for."""
    gib = 2**30
    assert liger.FLCE_LOGITS_BYTES == 4 * gib
    assert round(liger.logits_chunk_bytes(8, 262144, 4096, 128256) / gib, 2) == 15.66
    assert [liger.chunk_budget_in_force(8, tokens, 4096, 128256) for tokens in (65536, 262144, 360448)] == [8, 2, 1]
    assert liger.chunk_budget_in_force(8, 32768, 2048, 151936) == 8 and liger.chunk_budget_in_force(4, 32768, 2048,
                                                                                                      151936) == 4
    assert liger.chunk_budget_in_force(8, None, 4096, 128256) == 8  # tokens not known: the flag's
    for hidden, vocab in ((4096, 128256), (2048, 128256), (4096, 151936)):  # Llama 3.1 8B, Llama 3.2 1B, Qwen3-8B
        for tokens in range(4096, 1048577, 4096):
            budget = liger.chunk_budget_in_force(8, tokens, hidden, vocab)
            logits = liger.logits_chunk_bytes(budget, tokens, hidden, vocab)
            assert logits <= liger.FLCE_LOGITS_BYTES or budget == 1, (hidden, vocab, tokens, budget)
            assert budget == 8 or liger.logits_chunk_bytes(budget + 1, tokens, hidden, vocab) > liger.FLCE_LOGITS_BYTES
    assert liger.logits_chunk_bytes(1, 528384, 4096, 128256) > liger.FLCE_LOGITS_BYTES


def _reference_fa4(q, k, v, scale):
    """Stand-in for the FlashAttention-4 custom op (its CuTe kernels need a Hopper/Blackwell GPU): the same contract,
    (batch, seq, heads, head_dim) in, out and log-sum-exp out, computed by SDPA's math path."""
    import torch
    import torch.nn.functional as F

    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                         scale=scale, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), torch.zeros(q.shape[0], q.shape[2], q.shape[1])


def test_fa4_attention_wrapper_layout_and_fallbacks(monkeypatch):
    """fa4_attention's own logic on CPU: transposes in and out (GQA: 4 query heads on 2 KV heads), and SDPA for what
    FA4 does not take (a mask, fp32, non-causal, a query shorter than the keys). The kernel is a stand-in."""
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    calls = []
    monkeypatch.setattr(flash_attn4, "_fa4_kernel", lambda *a: calls.append(a) or _reference_fa4(*a))
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 8, 16), torch.randn(2, 2, 8, 16), torch.randn(2, 2, 8, 16)
    module = _Attention()
    module.num_key_value_groups = 2
    bq, bk, bv = (t.bfloat16() for t in (q, k, v))
    out, weights = flash_attn4.fa4_attention(module, bq, bk, bv, None, scaling=0.25)
    expected, _ = sdpa_attention_forward(module, bq, bk, bv, None, scaling=0.25)
    assert len(calls) == 1 and weights is None
    assert out.shape == (2, 8, 4, 16) and torch.allclose(out.float(), expected.float(), **BF16_PATHS)
    assert all(t.is_contiguous() and t.shape[1] == 8 for t in calls[0][:3])  # (batch, seq, heads, dim)
    assert calls[0][3] == 0.25

    mask = torch.ones(2, 1, 8, 8, dtype=torch.bool).tril()
    cases = {"mask": dict(query=bq, attention_mask=mask), "fp32": dict(query=q, key=k, value=v),
             "non-causal": dict(query=bq, is_causal=False), "short query": dict(query=bq[:, :, -1:])}
    for name, case in cases.items():
        args = dict(query=bq, key=bk, value=bv, attention_mask=None) | case
        out, _ = flash_attn4.fa4_attention(module, args.pop("query"), args.pop("key"), args.pop("value"),
                                    args.pop("attention_mask"), scaling=0.25, **args)
        assert len(calls) == 1, f"{name} went to FA4"
        assert torch.isfinite(out.float()).all(), name


def _reference_fa4_varlen(q, k, v, cu_seqlens, max_seqlen, scale):
    """Stand-in for the variable-length FlashAttention-4 op: (tokens, heads, head_dim), causal attention within each
    document of cu_seqlens, computed per document by SDPA's math path."""
    import torch
    import torch.nn.functional as F

    out = torch.empty_like(q)
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        assert 0 < end - start <= max_seqlen
        part = (t[start:end].transpose(0, 1) for t in (q, k, v))
        out[start:end] = F.scaled_dot_product_attention(*part, is_causal=True, scale=scale, enable_gqa=True).transpose(0, 1)
    return out, torch.zeros(q.shape[1], q.shape[0])


def test_fa4_probe_compiles_both_variants_of_the_variable_length_kernels():
    """FlashAttention-4 compiles its variable-length kernels once for batches of up to 256 sequences and once for more
    (its scheduler's threshold); a micro-batch of many short packed examples crossing it mid-run paid the second
    compilation inside a step. The probe's batches (its GPU forward and backward cannot run here) hold documents on
    both sides of the threshold, each a valid boundary list over the probe's tokens; where flash-attn-4 is installed,
    the threshold is its own."""
    cases = flash_attn4.probe_document_boundaries()
    for boundaries in cases:  # over 2 rows of 256 tokens, no document across a row's end
        assert boundaries[0] == 0 and boundaries[-1] == 512 and 256 in boundaries
        assert all(a < b for a, b in zip(boundaries, boundaries[1:]))
    documents = sorted(len(b) - 1 for b in cases)
    threshold = flash_attn4.FA4_VARLEN_SCHEDULER_THRESHOLD
    assert documents[0] <= threshold < documents[-1]
    try:
        from flash_attn.cute import interface
    except ImportError:  # CI: flash-attn-4 runs on Hopper and Blackwell GPUs only
        return
    assert interface.BIN_BATCH_SEARCH_THRESH == threshold


def test_fa4_attention_takes_documents_as_boundaries(monkeypatch):
    """--document_mask through FA4 on CPU (the kernels are stand-ins): with the documents' boundaries the variable-
    length op gets the flattened tokens, and the result equals SDPA under the dense per-document mask transformers
    builds; where FA4 does not apply (fp32) that mask still goes to SDPA."""
    import numpy as np
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from model_utils.data.blocks import document_boundaries, document_positions

    dense, varlen = [], []
    monkeypatch.setattr(flash_attn4, "_fa4_kernel", lambda *a: dense.append(a) or _reference_fa4(*a))
    monkeypatch.setattr(flash_attn4, "_fa4_varlen_kernel", lambda *a: varlen.append(a) or _reference_fa4_varlen(*a))
    tokens = np.array([[5, 6, 0, 7, 8, 0, 9, 9], [1, 2, 3, 4, 5, 6, 0, 1]])  # EOS = 0
    positions = document_positions(tokens, 0)
    boundaries = torch.from_numpy(document_boundaries(positions))
    doc = torch.from_numpy(positions == 0).cumsum(-1)  # document index per token, as transformers derives it
    mask = ((doc[:, :, None] == doc[:, None, :]) & torch.ones(8, 8, dtype=torch.bool).tril())[:, None]
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 8, 16), torch.randn(2, 2, 8, 16), torch.randn(2, 2, 8, 16)
    module = _Attention()
    module.num_key_value_groups = 2
    bq, bk, bv = (t.bfloat16() for t in (q, k, v))
    documents = dict(cu_seq_lens_q=boundaries, cu_seq_lens_k=boundaries, max_length_q=8, max_length_k=8)
    out, _ = flash_attn4.fa4_attention(module, bq, bk, bv, mask, scaling=0.25, **documents)
    expected, _ = sdpa_attention_forward(module, bq, bk, bv, mask, scaling=0.25)
    assert not dense and len(varlen) == 1
    assert [tuple(t.shape) for t in varlen[0][:3]] == [(16, 4, 16), (16, 2, 16), (16, 2, 16)]
    assert varlen[0][3] is boundaries and varlen[0][4:] == (8, 0.25)
    assert out.shape == (2, 8, 4, 16) and torch.allclose(out.float(), expected.float(), **BF16_PATHS)
    causal_only, _ = sdpa_attention_forward(module, bq, bk, bv, None, scaling=0.25, is_causal=True)
    assert not torch.allclose(out.float(), causal_only.float(), **BF16_PATHS)  # the documents made a difference

    out32, _ = flash_attn4.fa4_attention(module, q, k, v, mask, scaling=0.25, **documents)
    assert len(varlen) == 1 and not dense
    assert torch.allclose(out32, sdpa_attention_forward(module, q, k, v, mask, scaling=0.25)[0], atol=1e-5)


def test_the_data_parallel_view_of_a_split_checkpoint_records_no_tensor_parallelism(tmp_path):
    """A checkpoint as a --sequence_parallel 2 run writes it (DeepSpeed records the Ulysses group as tensor parallelism
    2 in its one model-state file): the view links every other file and writes the model state again with tensor
    parallelism 1, everything else in it unchanged; the checkpoint itself is not touched."""
    import torch
    from deepspeed.checkpoint.constants import CHECKPOINT_PARALLEL_DIMS, CHECKPOINT_PP_DEGREE, CHECKPOINT_TP_DEGREE

    from model_utils.patches.deepspeed_checkpoint import data_parallel_view

    checkpoint = tmp_path / "step-00000004"
    checkpoint.mkdir()
    state = {"module": {"w": torch.arange(4.0)}, CHECKPOINT_PARALLEL_DIMS: {CHECKPOINT_PP_DEGREE: 1,
                                                                           CHECKPOINT_TP_DEGREE: 2}}
    torch.save(state, checkpoint / "mp_rank_00_model_states.pt")
    for rank in range(2):
        (checkpoint / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt").write_bytes(b"partition %d" % rank)
    (checkpoint / "manifest.json").write_text("{}")
    view = data_parallel_view(checkpoint, tmp_path / "step-00000004-view")
    assert sorted(p.name for p in view.iterdir()) == sorted(p.name for p in checkpoint.iterdir())
    assert (view / "zero_pp_rank_1_mp_rank_00_optim_states.pt").read_bytes() == b"partition 1"
    assert (view / "manifest.json").is_symlink()
    rewritten = torch.load(view / "mp_rank_00_model_states.pt", weights_only=False)
    assert rewritten[CHECKPOINT_PARALLEL_DIMS] == {CHECKPOINT_PP_DEGREE: 1, CHECKPOINT_TP_DEGREE: 1}
    assert torch.equal(rewritten["module"]["w"], torch.arange(4.0))
    original = torch.load(checkpoint / "mp_rank_00_model_states.pt", weights_only=False)
    assert original[CHECKPOINT_PARALLEL_DIMS][CHECKPOINT_TP_DEGREE] == 2
