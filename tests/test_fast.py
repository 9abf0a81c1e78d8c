"""CPU tests of the speed levers' fall-backs (src/model_utils/fast.py) and of benchmarks/bench.py's arithmetic,
plus a CPU smoke run of the benchmark on the tiny preset (the same code path as on GPUs)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "benchmarks"))

from model_utils import fast, train_utils  # noqa: E402


@pytest.mark.parametrize("given, expected", [
    ("9.0a", "9.0"), ("8.0;9.0a", "8.0;9.0"), ("9.0a+PTX", "9.0+PTX"), ("10.0f 9.0a", "10.0;9.0"), ("9.0;9.0a", "9.0"),
])
def test_cuda_arch_list_is_normalised_for_deepspeed(monkeypatch, given, expected):
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", given)
    assert train_utils.normalize_cuda_arch_list() == expected
    for item in expected.split(";"):
        major, minor = item.replace("+PTX", "").split(".")
        int(major), int(minor)  # what DeepSpeed's op builder does


def test_cuda_arch_list_unset_stays_unset(monkeypatch):
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    assert train_utils.normalize_cuda_arch_list() is None


def test_lever_switches_validate(monkeypatch):
    for name in fast.LEVERS:
        monkeypatch.delenv(fast.lever_env(name), raising=False)
    assert fast.lever_settings() == {"compile": "auto", "liger": "auto", "sdpa": "auto", "attn": "auto",
                                     "overflow_check": "auto", "grad_norm": "auto", "flce_chunk": "auto",
                                     "activation_budget": 0.9}
    monkeypatch.setenv("DSLM_SDPA", "turbo")
    with pytest.raises(ValueError, match="DSLM_SDPA"):
        fast.lever_settings()
    problem = fast.fused_kernels_problem("auto", cuda=False)
    assert problem is not None and "DSLM_SDPA" in problem.message
    monkeypatch.delenv("DSLM_SDPA")
    for bad in ("0", "1.5", "most"):
        monkeypatch.setenv("DSLM_ACTIVATION_BUDGET", bad)
        problem = fast.fused_kernels_problem("auto", cuda=False)
        assert problem is not None and "DSLM_ACTIVATION_BUDGET" in problem.message and bad in problem.message
    monkeypatch.setenv("DSLM_ACTIVATION_BUDGET", "0.75")
    monkeypatch.setenv("DSLM_FLCE_CHUNK", "4")
    assert fast.lever_settings()["activation_budget"] == 0.75 and fast.lever_settings()["flce_chunk"] == "4"


def test_fa4_runs_only_where_it_can(monkeypatch):
    """`auto` takes FlashAttention-4 where it can run (package, GPU), `sdpa` never; `fa4` by name is refused without
    a GPU. No GPU here: where FA4 could run is stated through fa4_unavailable_reason."""
    import torch

    monkeypatch.delenv("DSLM_ATTN", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the same answer on a GPU host
    model = _tiny_model()
    assert "GPU" in fast.fa4_unavailable_reason()
    assert not fast.use_fa4(cuda=True, model=model)
    monkeypatch.setattr(fast, "fa4_unavailable_reason", lambda: None)
    assert fast.use_fa4(cuda=True, model=model)
    assert not fast.use_fa4(cuda=False, model=model)
    monkeypatch.setenv("DSLM_ATTN", "sdpa")
    assert not fast.use_fa4(cuda=True, model=model)
    monkeypatch.setenv("DSLM_ATTN", "fa4")
    assert fast.use_fa4(cuda=True, model=model)
    monkeypatch.setattr(fast, "fa4_unavailable_reason", lambda: "flash-attn-4 is not importable (no module)")
    problem = fast.fused_kernels_problem("auto", cuda=True)
    assert problem is not None and problem.setting == "DSLM_ATTN" and "not importable" in problem.message


def test_auto_attention_falls_back_to_sdpa_when_fa4_fails_its_probe(monkeypatch):
    """`auto` switches the model to FA4 only after the setup probe (a small forward and backward) succeeds; a failure
    leaves SDPA and says why. `fa4` by name skips the probe. The probe's own exception handling runs for real (a
    registration that raises); its GPU forward/backward cannot run here."""
    monkeypatch.setenv("DSLM_COMPILE", "off")
    monkeypatch.delenv("DSLM_ATTN", raising=False)
    monkeypatch.setattr(fast, "fa4_unavailable_reason", lambda: None)
    monkeypatch.setattr(fast, "_register_fa4", lambda: None)

    def boom():
        raise RuntimeError("CuTe DSL: unsupported driver\nmore detail")

    with monkeypatch.context() as m:
        m.setattr(fast, "_register_fa4", boom)
        assert fast.fa4_probe_failure(_tiny_model()) == "RuntimeError: CuTe DSL: unsupported driver"

    logs, warnings = [], []
    monkeypatch.setattr(fast, "fa4_probe_failure", lambda model, documents=False: "RuntimeError: boom")
    model = _tiny_model()
    fast.apply_fused_kernels(model, "off", cuda=True, log=logs.append, warn=warnings.append)
    assert model.config._attn_implementation == "sdpa"
    assert any("failed its setup probe (RuntimeError: boom); using SDPA" in line for line in warnings)  # every rank

    monkeypatch.setattr(fast, "fa4_probe_failure", lambda model, documents=False: None)
    model = _tiny_model()
    fast.apply_fused_kernels(model, "off", cuda=True, log=logs.append)
    assert model.config._attn_implementation == fast.FA4_NAME

    monkeypatch.setenv("DSLM_ATTN", "fa4")
    monkeypatch.setattr(fast, "fa4_probe_failure", lambda model, documents=False: pytest.fail("fa4 by name is not probed"))
    model = _tiny_model()
    fast.apply_fused_kernels(model, "off", cuda=True, log=logs.append)
    assert model.config._attn_implementation == fast.FA4_NAME


class _Attention:
    is_causal = True


# bf16 results of two attention paths: each output rounded to bf16 (a relative step of up to 2**-7), so up to two
# roundings apart; with torch 2.13 and transformers 5.23, SDPA's output is one step from the stand-in's where
# |outputs| reach 2-4 (a step of 0.0156).
BF16_PATHS = dict(atol=1e-2, rtol=2**-6)


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
    monkeypatch.setattr(fast, "_fa4_kernel", lambda *a: calls.append(a) or _reference_fa4(*a))
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 8, 16), torch.randn(2, 2, 8, 16), torch.randn(2, 2, 8, 16)
    module = _Attention()
    module.num_key_value_groups = 2
    bq, bk, bv = (t.bfloat16() for t in (q, k, v))
    out, weights = fast.fa4_attention(module, bq, bk, bv, None, scaling=0.25)
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
        out, _ = fast.fa4_attention(module, args.pop("query"), args.pop("key"), args.pop("value"),
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


def test_fa4_attention_takes_documents_as_boundaries(monkeypatch):
    """--document_mask through FA4 on CPU (the kernels are stand-ins): with the documents' boundaries the variable-
    length op gets the flattened tokens, and the result equals SDPA under the dense per-document mask transformers
    builds; where FA4 does not apply (fp32) that mask still goes to SDPA."""
    import numpy as np
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from model_utils.concat_dataset import document_boundaries, document_positions

    dense, varlen = [], []
    monkeypatch.setattr(fast, "_fa4_kernel", lambda *a: dense.append(a) or _reference_fa4(*a))
    monkeypatch.setattr(fast, "_fa4_varlen_kernel", lambda *a: varlen.append(a) or _reference_fa4_varlen(*a))
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
    out, _ = fast.fa4_attention(module, bq, bk, bv, mask, scaling=0.25, **documents)
    expected, _ = sdpa_attention_forward(module, bq, bk, bv, mask, scaling=0.25)
    assert not dense and len(varlen) == 1
    assert [tuple(t.shape) for t in varlen[0][:3]] == [(16, 4, 16), (16, 2, 16), (16, 2, 16)]
    assert varlen[0][3] is boundaries and varlen[0][4:] == (8, 0.25)
    assert out.shape == (2, 8, 4, 16) and torch.allclose(out.float(), expected.float(), **BF16_PATHS)
    causal_only, _ = sdpa_attention_forward(module, bq, bk, bv, None, scaling=0.25, is_causal=True)
    assert not torch.allclose(out.float(), causal_only.float(), **BF16_PATHS)  # the documents made a difference

    out32, _ = fast.fa4_attention(module, q, k, v, mask, scaling=0.25, **documents)
    assert len(varlen) == 1 and not dense
    assert torch.allclose(out32, sdpa_attention_forward(module, q, k, v, mask, scaling=0.25)[0], atol=1e-5)


def test_flce_chunk_budget_becomes_the_default_of_ligers_loss_function(monkeypatch):
    """Liger's Triton kernels cannot be imported without a GPU toolchain here, so its `functional` module is a
    stand-in with the real function's signature; what is tested is the project's wrapper: the default it injects, an
    explicit value still winning, and the signature Liger's loss inspects to filter its kwargs."""
    import inspect
    import types

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
    fast._liger_flce_original.cache_clear()
    try:
        fast._set_flce_chunk_budget(fast.flce_chunk_budget({"flce_chunk": "auto"}), log=lambda m: None)
        wrapped = functional.liger_fused_linear_cross_entropy
        wrapped(1, 2, 3)
        wrapped(1, 2, 3, chunk_mem_const=2)
        assert seen == [fast.FLCE_CHUNK_AUTO, 2]
        assert "chunk_mem_const" in inspect.signature(wrapped).parameters
        fast._set_flce_chunk_budget(fast.flce_chunk_budget({"flce_chunk": "4"}), log=lambda m: None)  # applied twice: wraps the original, not the wrapper
        functional.liger_fused_linear_cross_entropy(1, 2, 3)
        assert seen[-1] == 4
    finally:
        fast._liger_flce_original.cache_clear()


# Runs in a fresh process (DeepSpeed initialises torch.distributed): bf16 ZeRO-2 on CPU, the same optimizer class and
# step() as on GPUs (torch's fused AdamW, as ds_config.json), with a warm-up LR schedule so that every scheduler step
# shows. A NaN loss first, a finite step, an inf in one gradient tensor only (a hook on the last layer's bias), then a
# finite step: all overflow checks must skip the same steps, with the same LR afterwards, and leave bitwise-equal
# parameters; the multi-tensor gradient norm must give DeepSpeed's norm (and the same clipped update) to fp32
# rounding. The loop's booking of a step the GPU skipped (DSLM_OVERFLOW_CHECK=device) is the trainer's:
# device_skip_flag, then settle_device_skip.
OVERFLOW_SCRIPT = r"""
import json, os, sys, torch
rank, world = (int(a) for a in (sys.argv[4:6] if len(sys.argv) > 4 else (0, 1)))
os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                  MASTER_PORT=sys.argv[2])
os.environ["DSLM_OVERFLOW_CHECK"], os.environ["DSLM_GRAD_NORM"] = sys.argv[1].split("+")
sys.path.insert(0, sys.argv[3])
import deepspeed
from model_utils import fast
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
ds = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 0.05,
      "bf16": {"enabled": True, "check_grad_overflow": True},
      "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True, "fused": True}},
      "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 1e-3, "warmup_max_lr": 1e-2,
                                                    "warmup_num_steps": 8, "warmup_type": "linear"}},
      "zero_optimization": {"stage": 2}}
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds)
streamlined = fast.streamline_zero_step(engine, lambda message: None)
poison = {"on": False}
engine.module[2].bias.register_hook(lambda g: g.masked_fill(torch.ones_like(g, dtype=torch.bool), float("inf"))
                                    if poison["on"] and rank == world - 1 else g)  # the last rank's gradient only
x = torch.randn(2 * world, 16, dtype=torch.bfloat16)[2 * rank:2 * rank + 2]  # each rank its own batch
steps, norms = [], []
for kind in ("nan_loss", "finite", "inf_in_one_tensor", "finite"):  # the first step skipped, too
    before = [p.detach().clone() for p in engine.module.parameters()]
    poison["on"] = kind == "inf_in_one_tensor"
    loss = engine(x).float().pow(2).mean() * (float("nan") if kind == "nan_loss" else 1.0)
    engine.backward(loss)
    engine.step()
    if fast.device_skip_flag(engine, "cpu").item() > 0:
        fast.settle_device_skip(engine)
    updated = any(not torch.equal(a, b) for a, b in zip(before, engine.module.parameters()))
    steps.append({"kind": kind, "updated": updated, "skipped_steps": engine.skipped_steps,
                  "applied": engine.was_step_applied(), "lr": engine.get_lr()[0]})
    norms.append(float(engine.get_global_grad_norm()))
params = [p.detach().float().flatten().tolist() for p in engine.module.parameters()]
patched = sorted(k for k in ("check_overflow", "get_grad_norm_direct", "scaled_global_norm")
                 if k in vars(engine.optimizer))
print("RESULT " + json.dumps({"streamlined": streamlined, "patched": patched, "steps": steps, "params": params,
                              "norms": norms}))
"""


def test_streamlined_zero_step_skips_and_clips_like_deepspeed():
    import json

    from model_utils.train_utils import free_port

    results = {}
    for mode in ("scan+deepspeed", "norm+deepspeed", "norm+foreach", "device+foreach"):
        out = subprocess.run([sys.executable, "-c", OVERFLOW_SCRIPT, mode, str(free_port()), str(REPO / "src")],
                             capture_output=True, text=True, timeout=240)
        line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
        assert line, out.stdout[-2000:] + out.stderr[-3000:]
        results[mode] = json.loads(line[len("RESULT "):])
    scan, norm, foreach = results["scan+deepspeed"], results["norm+deepspeed"], results["norm+foreach"]
    device = results["device+foreach"]
    assert (scan["patched"], norm["patched"]) == ([], ["check_overflow"])
    assert foreach["patched"] == ["check_overflow", "get_grad_norm_direct"]
    assert device["patched"] == ["check_overflow", "get_grad_norm_direct", "scaled_global_norm"]
    assert [s["updated"] for s in norm["steps"]] == [False, True, False, True]
    assert [s["applied"] for s in norm["steps"]] == [False, True, False, True]
    lrs = [s["lr"] for s in scan["steps"]]
    assert lrs[0] == lrs[1] == lrs[2] < lrs[3]  # the skipped steps did not advance the warm-up
    assert norm["steps"] == scan["steps"] == foreach["steps"] == device["steps"]
    assert norm["steps"][-1]["skipped_steps"] == 2
    assert norm["params"] == scan["params"]
    assert device["params"] == foreach["params"]
    assert device["norms"] == foreach["norms"]  # inf where skipped, as DeepSpeed reports
    # The clipping threshold (0.05) is below the norms, so the update depends on the norm's value.
    finite = [i for i, s in enumerate(scan["steps"]) if s["updated"]]
    assert all(scan["norms"][i] > 0.05 for i in finite)
    for i in finite:
        assert abs(foreach["norms"][i] - scan["norms"][i]) <= 1e-5 * scan["norms"][i]
    flat = lambda r: [x for p in r["params"] for x in p]  # noqa: E731
    assert max(abs(a - b) for a, b in zip(flat(foreach), flat(scan))) <= 1e-2 * max(abs(x) for x in flat(scan))


def test_gpu_skipped_step_is_skipped_on_every_rank():
    """Two ranks (gloo), each its own batch; the inf is in the last rank's gradient only. With the verdict on the
    device every rank must skip the same steps as with DeepSpeed's host check, and the replicas stay identical."""
    import json

    from model_utils.train_utils import free_port

    results = {}
    for mode in ("norm+foreach", "device+foreach"):
        port = str(free_port())
        procs = [subprocess.Popen([sys.executable, "-c", OVERFLOW_SCRIPT, mode, port, str(REPO / "src"), str(rank), "2"],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
        outputs = [p.communicate(timeout=240) for p in procs]
        lines = [next((x for x in out.splitlines() if x.startswith("RESULT ")), None) for out, _ in outputs]
        assert all(lines), "\n".join(out[-2000:] + err[-3000:] for out, err in outputs)
        results[mode] = [json.loads(line[len("RESULT "):]) for line in lines]
    host, device = results["norm+foreach"], results["device+foreach"]
    assert [s["updated"] for s in host[0]["steps"]] == [False, True, False, True]
    for rank in (0, 1):
        assert device[rank]["steps"] == host[rank]["steps"] == host[0]["steps"]
        assert device[rank]["params"] == host[rank]["params"] == host[0]["params"]


def test_compile_only_with_cuda_and_not_under_zero3():
    on = {"compile": "auto", "liger": "auto", "sdpa": "auto"}
    assert fast.use_compile(cuda=True, zero3=False, settings=on)
    assert not fast.use_compile(cuda=False, zero3=False, settings=on)
    assert not fast.use_compile(cuda=True, zero3=True, settings=on)
    assert not fast.use_compile(cuda=True, zero3=False, settings=dict(on, compile="off"))


def test_fused_kernels_fall_back_without_liger(monkeypatch):
    monkeypatch.setattr(fast, "liger_available", lambda: False)
    assert not fast.use_fused_kernels("auto", cuda=True)
    assert fast.fused_kernels_problem("on", cuda=True) is not None
    assert fast.fused_kernels_problem("auto", cuda=True) is None


def _tiny_model():
    from model_utils.models import build_model, model_config
    from model_utils.tokenizer import load_tokenizer

    return build_model("tiny", model_config("tiny", load_tokenizer(None)), __import__("torch").float32, "sdpa", False)


def test_a_gpu_run_without_liger_says_so(monkeypatch):
    monkeypatch.setenv("DSLM_COMPILE", "off")
    monkeypatch.setenv("DSLM_ATTN", "sdpa")
    monkeypatch.setattr(fast, "liger_available", lambda: False)
    messages = []
    assert fast.apply_fused_kernels(_tiny_model(), "auto", cuda=True, log=messages.append) is False
    assert any("liger-kernel is not installed" in m and ".[gpu]" in m for m in messages)


def test_all_levers_are_no_ops_on_cpu(monkeypatch):
    """Every switch on, but no GPU: the model is left exactly as built, so CI runs the default code path."""
    import torch

    monkeypatch.setenv("DSLM_COMPILE", "layers")
    monkeypatch.setenv("DSLM_SDPA", "cudnn")
    monkeypatch.setenv("DSLM_LIGER", "all")
    model = _tiny_model()
    forward = model.forward
    layer_calls = [layer._compiled_call_impl for layer in model.model.layers]
    messages = []
    assert fast.apply_fused_kernels(model, "auto", cuda=False, log=messages.append) is False
    assert messages == [] and model.forward == forward
    assert [layer._compiled_call_impl for layer in model.model.layers] == layer_calls
    ids = torch.randint(0, 100, (1, 16))
    assert torch.isfinite(model(input_ids=ids, labels=ids).loss)


def test_throughput_arithmetic():
    import bench

    r = bench.throughput(8 * 4096, [0.5, 0.5, 0.5, 0.5], 6.0e9, 4.0e9, 989.0)
    assert r["tokens_per_s_per_gpu"] == pytest.approx(65536.0)
    assert r["tflops_per_gpu"] == pytest.approx(65536.0 * 6.0e9 / 1e12)
    assert r["mfu"] == pytest.approx(65536.0 * 6.0e9 / 1e12 / 989.0)
    assert r["mfu_6"] == pytest.approx(65536.0 * 4.0e9 / 1e12 / 989.0)
    assert "mfu" not in bench.throughput(1, [1.0], 1.0, 1.0, None)


def test_flops_per_token_conventions_for_qwen3_0_6b():
    import bench
    from model_utils.models import model_config

    config = model_config("qwen3-0.6b")
    params = 596_049_920  # Qwen3-0.6B with tied embeddings, as counted on the GPU run
    f12, f6 = bench.flops_per_token(config, params, 4096)
    attn = 28 * 16 * 128 * 4096
    assert f12 == 6 * params + 12 * attn  # tied: the LM head counts once, the embedding lookup not at all
    assert f6 == 6 * params + 6 * attn


def test_loss_check_and_table():
    import bench

    lc = bench.loss_check({"losses": [10.0, 9.0, 8.0]}, {"losses": [10.0, 9.01, 7.98]}, 50)
    assert lc["steps"] == 3 and lc["max_abs_diff"] == pytest.approx(0.02)
    jobs = [{"name": "a", "micro_batch_size": 8}, {"name": "ref", "micro_batch_size": 8}, {"name": "x", "micro_batch_size": 8}]
    res = [{"micro_batch_size": 8, "tokens_per_s_per_gpu": 120.0, "tflops_per_gpu": 1.0, "step_s_median": 0.1},
           {"micro_batch_size": 8, "tokens_per_s_per_gpu": 100.0, "tflops_per_gpu": 1.0, "step_s_median": 0.1},
           {"error": "out of memory"}]
    text = bench.table(jobs, res, "ref")
    assert "1.20x" in text and "out of memory" in text


def test_ratios_per_micro_batch_and_best_micro_batch_each():
    import bench

    def run(mb, tps):
        return {"micro_batch_size": mb, "tokens_per_s_per_gpu": tps, "tflops_per_gpu": 1.0, "step_s_median": 0.1}

    jobs = [{"name": "e8", "kind": "engine", "variant": "default", "micro_batch_size": 8},
            {"name": "h8", "kind": "hf", "liger": True, "attn": "sdpa", "micro_batch_size": 8},
            {"name": "e16", "kind": "engine", "variant": "default", "micro_batch_size": 16},
            {"name": "h16", "kind": "hf", "liger": True, "attn": "sdpa", "micro_batch_size": 16}]
    results = [run(8, 120.0), run(8, 100.0), run(16, 150.0), {"error": "out of memory"}]
    rows = bench.table(jobs, results, "h8").splitlines()
    assert rows[2].endswith("| 1.20x |") and rows[4].endswith("| - |")  # h16 did not run: no ratio for e16
    best = bench.best_per_side(jobs, results)
    assert "150 tokens/s at 16" in best and "100 at 8" in best and "failed at [16]" in best and best.endswith("1.50x")
    assert bench.best_per_side(jobs[:2], results[:2]) == ""  # one micro-batch: nothing to choose
    no_liger = {"name": "n16", "kind": "hf", "liger": False, "attn": "sdpa", "micro_batch_size": 16}
    assert "failed at [16]" in bench.best_per_side(jobs + [no_liger], results + [{"error": "out of memory"}])


def test_rounds_interleave_both_sides_and_pool_their_best_micro_batches():
    """--rounds N runs the invocation's measurements N times in turn (each side at its own micro-batches with
    --hf-micro-batch-size); each round's ratio is to that round's peer, and the pooled line takes each side's mean
    tokens/s at the micro-batch that is best on average."""
    import argparse

    import bench

    a = argparse.Namespace(model="tiny", seq_len=32, steps=2, warmup=1, seed=1, ds_config="ds_config.json",
                           zero_stage=None, gradient_checkpointing=False, profile=False, ds_set=[], document_length=0,
                           trace=None, nproc=1, micro_batch_size=[16], hf_micro_batch_size=[12, 16], rounds=3,
                           variants=["default"], compare_hf=True, hf_skip=["noliger"], hf_fa4=False, loss_check=5,
                           loss_check_reference="nofused", loss_check_variants=["default"], loss_check_mb=2)
    names = [j["name"] for j in bench.make_jobs(a)]
    assert names == [f"{n}-r{k}" for k in (1, 2, 3) for n in ("engine-default-mb16", "hf-liger-mb16", "hf-liger-mb12")] \
        + ["losscheck-nofused-mb2", "losscheck-default-mb2"]  # interleaved rounds; the loss check once
    traced = bench.make_jobs(argparse.Namespace(**dict(vars(a), profile=True, trace="/tmp/traces", loss_check=0)))
    assert [j["trace"] for j in traced if j["kind"] == "engine"] == [
        f"/tmp/traces/engine-default-mb16-r{k}.json.gz" for k in (1, 2, 3)]  # a trace per round, none overwritten
    assert [j["name"] for j in bench.make_jobs(argparse.Namespace(**dict(vars(a), rounds=1, loss_check=0)))] == \
        ["engine-default-mb16", "hf-liger-mb16", "hf-liger-mb12"]  # one round: the names of old

    def run(mb, tps):
        return {"micro_batch_size": mb, "tokens_per_s_per_gpu": tps, "tflops_per_gpu": 1.0, "step_s_median": 0.1}

    jobs, results = [], []
    for k, (ours16, ours12, peer12) in enumerate([(120.0, 118.0, 100.0), (126.0, 125.0, 100.0), (120.0, 130.0, 110.0)], 1):
        jobs += [{"name": f"e16-r{k}", "kind": "engine", "variant": "default", "micro_batch_size": 16, "round": k},
                 {"name": f"e12-r{k}", "kind": "engine", "variant": "default", "micro_batch_size": 12, "round": k},
                 {"name": f"h12-r{k}", "kind": "hf", "liger": True, "attn": "sdpa", "micro_batch_size": 12, "round": k},
                 {"name": f"h16-r{k}", "kind": "hf", "liger": True, "attn": "sdpa", "micro_batch_size": 16, "round": k}]
        results += [run(16, ours16), run(12, ours12), run(12, peer12), {"error": "out of memory"}]
    rows = bench.table(jobs, results, None).splitlines()
    assert rows[3].endswith("| 1.18x |") and rows[11].endswith("| 1.18x |")  # each round's own peer (130/110)
    lines = bench.best_per_side(jobs, results).splitlines()
    assert lines[0] == ("Round 1, best micro-batch each: default path 120 tokens/s at 16, HF + Liger 100 at 12 "
                        "(failed at [16]): 1.200x")
    assert lines[2].endswith("default path 130 tokens/s at 12, HF + Liger 110 at 12 (failed at [16]): 1.182x")
    # pooled: ours 124.3 at 12 (16 averages 122), the peer 103.3 at 12; rounds 1.200x, 1.260x, 1.182x
    assert lines[3] == ("Over 3 rounds, each side's mean at its best micro-batch: default path 124 tokens/s at 12, "
                        "HF + Liger 103 at 12 (failed at [16]): 1.203x (rounds 1.182x-1.260x, median 1.200x)")


def test_sweep_skips_larger_micro_batches_after_out_of_memory():
    import bench

    jobs = [{"name": f"{v}-{mb}", "variant": v, "micro_batch_size": mb} for mb in (4, 8, 12, 16) for v in ("a", "b")]
    ran = []

    def run(job):
        ran.append(job["name"])
        fits = job["micro_batch_size"] <= (12 if job["variant"] == "a" else 4)
        return {"tokens_per_s_per_gpu": 1.0} if fits else {"error": "out of memory"}

    results = bench.run_jobs(jobs, run, lambda job, r: None)
    assert ran == ["a-4", "b-4", "a-8", "b-8", "a-12", "a-16"]
    assert [r.get("error") for r in results] == [None, None, None, "out of memory", None,
                                                 "skipped (out of memory at 8)", "out of memory",
                                                 "skipped (out of memory at 8)"]


def test_gpu_samples_summary():
    """Rows as nvidia-smi printed them on the H100 (clock MHz, power W, clock event reasons), one it cannot fill."""
    import bench

    rows = ["1695, 693.50, 0x0000000000000004", "1980, 121.39, 0x0000000000000000",
            "1455, 696.23, 0x0000000000000084", "[N/A], [N/A], [N/A]", "1710"]
    summary = bench.summarize_gpu_samples(rows)
    assert summary["gpu_samples"] == 3
    assert summary["sm_clock_mhz"] == pytest.approx((1695 + 1980 + 1455) / 3)
    assert summary["power_w"] == pytest.approx((693.50 + 121.39 + 696.23) / 3)
    assert summary["power_limited_share"] == pytest.approx(2 / 3)  # SW power cap, and HW power brake with it
    assert bench.summarize_gpu_samples(["1980, 70.0, 0x0000000000000001"])["power_limited_share"] == 0  # idle
    assert bench.summarize_gpu_samples([]) == {}


def test_gpu_telemetry_samples_the_run_gpus(tmp_path, monkeypatch):
    """No GPU here: a stand-in nvidia-smi on PATH records its arguments and prints rows as `-lms` does."""
    import bench

    fake = tmp_path / "nvidia-smi"
    fake.write_text(f"#!/bin/sh\necho \"$@\" > {tmp_path}/args\n"
                    "echo '1700, 690.0, 0x0000000000000004'\necho '1800, 600.0, 0x0000000000000000'\nexec sleep 60\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5,6")
    telemetry = bench.GpuTelemetry(2, interval_ms=50).start()
    for _ in range(100):  # until the stand-in has printed its rows
        if (tmp_path / "args").exists() and os.fstat(telemetry.samples.fileno()).st_size >= 62:  # both rows
            break
        time.sleep(0.05)
    summary = telemetry.stop()
    assert summary == {"sm_clock_mhz": 1750.0, "power_w": 645.0, "power_limited_share": 0.5, "gpu_samples": 2}
    args = (tmp_path / "args").read_text().split()
    assert args[args.index("-i") + 1] == "3,5" and args[args.index("-lms") + 1] == "50"
    assert telemetry.stop() == {}  # stopped once; a second stop has nothing to add
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert bench.GpuTelemetry(1).start().stop() == {}  # no nvidia-smi (CPU machine): no figures, no error
    rows = bench.table([{"name": "e", "micro_batch_size": 8}],
                       [{"micro_batch_size": 8, "tokens_per_s_per_gpu": 1.0, "tflops_per_gpu": 1.0,
                         "step_s_median": 0.1, **summary}], None).splitlines()
    assert "| 1,750 / 645 / 50% |" in rows[2]


def test_hf_config_has_autos_for_trainer_owned_values(tmp_path):
    import bench

    ds = bench.hf_ds_config({"ds_config": "ds_config.json", "zero_stage": None}, tmp_path)
    assert ds["train_micro_batch_size_per_gpu"] == "auto" and ds["optimizer"]["params"]["lr"] == "auto"
    assert ds["zero_optimization"]["stage"] in (1, 2)
    ds0 = bench.hf_ds_config({"ds_config": "ds_config.json", "zero_stage": 0}, tmp_path)
    assert ds0["zero_optimization"] == {"stage": 0}


def test_bench_cpu_smoke_run(tmp_path):
    """The benchmark end to end on CPU: tiny preset, the trainer's setup/compute_loss, one timed step, and the HF
    Trainer peer without Liger. No GPU here: a stand-in nvidia-smi on PATH checks that both workers sample the clock
    over their timed steps."""
    fake = tmp_path / "bin" / "nvidia-smi"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\necho '1650, 690.0, 0x0000000000000004'\nexec sleep 60\n")
    fake.chmod(0o755)
    env = dict(os.environ, PATH=f"{fake.parent}:{os.environ['PATH']}")
    out = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench.py"), "--model", "tiny", "--seq_len", "32",
                          "--micro_batch_size", "1", "--steps", "2", "--warmup", "1", "--timeout", "240",
                          "--variants", "default", "document_mask", "--document_length", "8",
                          "--compare-hf", "--hf-skip", "liger", "--write-doc", str(tmp_path / "perf.md"),
                          "--json", str(tmp_path / "results.jsonl")],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    doc = (tmp_path / "perf.md").read_text()
    assert "| engine-default-mb1 | 1 |" in doc and "| hf-noliger-mb1 | 1 |" in doc
    assert "| engine-document_mask-mb1 | 1 |" in doc
    assert doc.count("| 1,650 / 690 / 100% |") == 3
    # The same documents (~8 tokens each) in both engine runs: attention within them changes the loss.
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    losses = {r["job"]["name"]: r["result"]["losses"] for r in rows if r["job"]["kind"] == "engine"}
    assert len(losses) == 2 and losses["engine-default-mb1"] != losses["engine-document_mask-mb1"]
    # ...and their FLOPs count each document's attention square, not the block's 32 x 32.
    flops = {r["job"]["name"]: r["result"]["tflops_per_gpu"] / r["result"]["tokens_per_s_per_gpu"] for r in rows
             if r["job"]["kind"] == "engine"}
    assert flops["engine-document_mask-mb1"] < flops["engine-default-mb1"] * (1 - 1e-3)


def test_gpu_idle_report_attributes_gaps_to_the_host():
    """A synthetic Kineto trace: two kernels 1 ms apart while the host is in the step phase's `norm` operator."""
    import bench

    events = [
        {"ph": "X", "cat": "user_annotation", "name": "phase:backward", "ts": 0, "dur": 1000},
        {"ph": "X", "cat": "user_annotation", "name": "phase:step", "ts": 1000, "dur": 3000},
        {"ph": "X", "cat": "cpu_op", "name": "step", "ts": 1000, "dur": 3000},
        {"ph": "X", "cat": "cpu_op", "name": "norm", "ts": 1100, "dur": 1000},
        {"ph": "X", "cat": "cpu_op", "name": "adam", "ts": 2100, "dur": 200},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 2150, "dur": 10, "args": {"correlation": 7}},
        {"ph": "X", "cat": "kernel", "name": "backward_kernel", "ts": 100, "dur": 1100},
        {"ph": "X", "cat": "kernel", "name": "small", "ts": 1205, "dur": 5},  # a 5 us gap: below the threshold
        {"ph": "X", "cat": "kernel", "name": "adam_kernel", "ts": 2210, "dur": 800, "args": {"correlation": 7}},
    ]
    report = bench.gpu_idle_report(events, min_gap_us=20).splitlines()
    assert report[0].startswith("gpu idle: 1.0 ms of 2.9 ms") and "in 1 gaps" in report[0]
    assert "step 1.0 ms" in report[0]
    assert "host in norm" in report[1] and "ended by adam_kernel launched from adam" in report[1]
    assert bench.gpu_idle_report([]) == "gpu idle: no GPU events in the trace"
