"""Attention within documents without a dense mask (models/document_attention.py) against transformers' own path,
SDPA under the block-diagonal mask it builds from positions that restart at each document: outputs and gradients of
the attention alone and of a whole model, SDPA once per document on this CPU; torch's varlen_attn is a CUDA kernel,
so its adapter is run here over a stand-in kernel (one exact causal softmax per document, written below) in both
signatures torch has shipped, and the kernel itself is checked on the GPU (`benchmarks/attention.py
--document_length N`: its outputs and gradients against the dense mask's, and its speed)."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from model_utils.data.blocks import document_boundaries, document_positions
from model_utils.models import document_attention as da


def _qkv(batch=2, heads=4, kv_heads=2, seq=24, dim=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    make = lambda h: torch.randn(batch, h, seq, dim, generator=g, dtype=torch.float64, requires_grad=True)  # noqa: E731
    return make(heads), make(kv_heads), make(kv_heads)


def _module(heads=4, kv_heads=2):
    return types.SimpleNamespace(is_causal=True, num_key_value_groups=heads // kv_heads, training=True)


def _dense_documents(query, key, value, positions, scaling=None):
    """transformers' own path: SDPA with the block-diagonal causal mask it builds from restarting positions."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    document = np.cumsum(positions == 0, axis=1)
    same = document[:, :, None] == document[:, None, :]
    causal = np.tril(np.ones(same.shape[1:], dtype=bool))
    mask = torch.from_numpy(same & causal)[:, None]
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    return sdpa_attention_forward(_module(), query, key, value, mask, scaling=scaling)[0]


def _documents():
    """Two rows of three and two documents (one cut at the row's end); token 2 ends a document."""
    tokens = np.array([[5, 5, 2, 5, 5, 5, 5, 2, 5] + [5] * 15, [5] * 10 + [2] + [5] * 13])
    positions = document_positions(tokens, eos_id=2)
    boundaries = torch.from_numpy(document_boundaries(positions))
    assert boundaries.tolist() == [0, 3, 8, 24, 35, 48]
    return positions, boundaries


def _assert_same_outputs_and_gradients(ours, dense, inputs, tolerance=1e-12):
    torch.testing.assert_close(ours, dense, rtol=tolerance, atol=tolerance)
    grads = torch.autograd.grad((ours * dense.detach().cos()).sum(), inputs)
    want = torch.autograd.grad((dense * dense.detach().cos()).sum(), inputs)
    for got, expected in zip(grads, want):
        torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance)


# ---- SDPA once per document -------------------------------------------------------------------------------------------
def test_sdpa_per_document_equals_the_dense_mask_in_outputs_and_gradients():
    positions, boundaries = _documents()
    q, k, v = _qkv()
    ours, _ = da.document_sdpa(_module(), q, k, v, None, scaling=q.shape[-1] ** -0.5, cu_seq_lens_q=boundaries,
                               cu_seq_lens_k=boundaries, max_length_q=24, position_ids=torch.from_numpy(positions))
    dense = _dense_documents(q, k, v, positions)
    assert ours.shape == dense.shape == (2, 24, 4, 8)
    _assert_same_outputs_and_gradients(ours, dense, (q, k, v))
    whole, _ = da.document_sdpa(_module(), q, k, v, None, scaling=q.shape[-1] ** -0.5)
    assert not torch.allclose(whole, ours)  # without the boundaries: causal over each whole row


# ---- torch's varlen_attn, through a stand-in for its CUDA kernel ------------------------------------------------------
def _stand_in_varlen(signature: str, calls: list):
    """A CPU stand-in for torch.nn.attention.varlen.varlen_attn (a CUDA-only kernel): exact causal attention within
    each [cu[i], cu[i+1]) of the flattened tokens, with the keywords of torch 2.10 ("is_causal"), 2.11 ("scale",
    "window_size") or 2.14 (also "enable_gqa"). It records what it was given."""

    def attend(query, key, value, cu_q, cu_k, max_q, max_k, causal, scale, gqa):
        assert cu_q.dtype == torch.int32 and torch.equal(cu_q, cu_k) and max_q == max_k and causal
        assert query.dim() == 3 and (gqa or key.shape[1] == query.shape[1])
        key, value = (t.repeat_interleave(query.shape[1] // t.shape[1], dim=1) for t in (key, value))
        out = []
        for start, end in zip(cu_q.tolist()[:-1], cu_q.tolist()[1:]):
            assert end - start <= max_q
            q, k, v = (t[start:end].transpose(0, 1) for t in (query, key, value))  # (heads, tokens, dim)
            scores = q @ k.transpose(1, 2) * (query.shape[-1] ** -0.5 if scale is None else scale)
            scores = scores.masked_fill(~torch.ones_like(scores, dtype=torch.bool).tril(), float("-inf"))
            out.append((scores.softmax(-1) @ v).transpose(0, 1))
        calls.append({"query": tuple(query.shape), "key": tuple(key.shape), "scale": scale, "gqa": gqa})
        return torch.cat(out)

    if signature == "torch-2.10":
        def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
            return attend(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal, None, False)
    elif signature == "torch-2.11":
        def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                        window_size=(-1, -1)):
            return attend(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, tuple(window_size) == (-1, 0), scale,
                          False)
    else:
        def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                        window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
            return attend(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, tuple(window_size) == (-1, 0), scale,
                          enable_gqa)
    return varlen_attn


@pytest.mark.parametrize("signature", ["torch-2.10", "torch-2.11", "torch-2.14"])
@pytest.mark.parametrize("scaling", [None, 0.2], ids=["default-scale", "model-scale"])
def test_varlen_documents_equals_the_dense_mask_in_outputs_and_gradients(monkeypatch, signature, scaling):
    import inspect

    calls = []
    kernel = _stand_in_varlen(signature, calls)
    monkeypatch.setattr(da, "_varlen", lambda: (kernel, frozenset(inspect.signature(kernel).parameters)))
    positions, boundaries = _documents()
    q, k, v = _qkv()
    ours, _ = da.varlen_documents(_module(), q, k, v, None, scaling=scaling, cu_seq_lens_q=boundaries.long(),
                                  cu_seq_lens_k=boundaries, max_length_q=24, max_length_k=24, is_causal=True,
                                  position_ids=torch.from_numpy(positions))
    _assert_same_outputs_and_gradients(ours, _dense_documents(q, k, v, positions, scaling), (q, k, v))
    # Keys and values of 2 heads for 4 query heads: torch 2.14's kernel shares them itself, the older ones get them
    # repeated; the model's scale goes to the kernel where it takes one, else into the queries.
    assert calls[0]["query"] == (48, 4, 8) and calls[0]["key"] == (48, 4, 8)
    assert calls[0]["gqa"] == (signature == "torch-2.14")
    assert calls[0]["scale"] == (None if signature == "torch-2.10" else scaling)
    whole, _ = da.varlen_documents(_module(), q, k, v, None, scaling=scaling)  # no boundaries: causal rows, SDPA
    assert len(calls) == 1 and not torch.allclose(whole, ours)


def test_attention_that_needs_a_mask_is_refused_not_computed_without_it():
    q, k, v = _qkv()
    _, boundaries = _documents()
    with pytest.raises(RuntimeError, match="sliding_window=8"):
        da.varlen_documents(_module(), q, k, v, None, sliding_window=8, cu_seq_lens_q=boundaries)
    with pytest.raises(RuntimeError, match="softcap=30"):
        da.document_sdpa(_module(), q, k, v, None, softcap=30.0, cu_seq_lens_q=boundaries)
    ours, _ = da.document_sdpa(_module(), q, k, v, None, sliding_window=24, cu_seq_lens_q=boundaries)  # no effect
    assert ours.shape == (2, 24, 4, 8)


# ---- whole models -----------------------------------------------------------------------------------------------------
def _tiny(model_type="llama", **extra):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, vocab_size=512, hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                  max_position_embeddings=256, **extra)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float64)


def test_a_model_on_per_document_attention_matches_transformers_dense_mask():
    """A tiny Llama on packed documents: the logits and every parameter's gradient with SDPA once per document (no
    mask built) equal those of transformers' SDPA under the mask it builds from the restarting positions."""
    tokens = torch.randint(3, 512, (2, 24), generator=torch.Generator().manual_seed(2))
    tokens[0, [2, 7]] = tokens[1, 10] = 2
    positions = document_positions(tokens.numpy(), eos_id=2)
    boundaries = torch.from_numpy(document_boundaries(positions))
    results = {}
    for path in ("dense", "documents"):
        model = _tiny()
        inputs = {"input_ids": tokens, "position_ids": torch.from_numpy(positions), "labels": tokens,
                  "use_cache": False}  # as training calls it: with a cache transformers masks no documents
        if path == "documents":
            assert da.enable_document_attention(model, lambda _: None) == "sdpa-documents"  # no CUDA here
            assert da.takes_document_boundaries(model)
            inputs.update(cu_seq_lens_q=boundaries, cu_seq_lens_k=boundaries, max_length_q=24, max_length_k=24)
        out = model(**inputs)
        out.loss.backward()
        results[path] = (out.logits.detach(), {n: p.grad for n, p in model.named_parameters()})
    torch.testing.assert_close(results["documents"][0], results["dense"][0], rtol=1e-10, atol=1e-10)
    for name, grad in results["dense"][1].items():
        torch.testing.assert_close(results["documents"][1][name], grad, rtol=1e-9, atol=1e-10, msg=name)


def test_which_models_keep_transformers_mask():
    assert da.mask_needed_reason(_tiny().config, 4096) is None
    assert "soft-caps" in da.mask_needed_reason(types.SimpleNamespace(attn_logit_softcapping=50.0), 4096)
    assert "dropout" in da.mask_needed_reason(types.SimpleNamespace(attention_dropout=0.1), 4096)
    mistral = types.SimpleNamespace(sliding_window=4096)
    assert da.mask_needed_reason(mistral, 4096) is None  # a window as long as the sequence changes nothing
    assert "sliding window of 4096 tokens" in da.mask_needed_reason(mistral, 8192)
    qwen = types.SimpleNamespace(sliding_window=4096, use_sliding_window=False, layer_types=["full_attention"] * 2)
    assert da.mask_needed_reason(qwen, 8192) is None
    gemma = types.SimpleNamespace(sliding_window=512, layer_types=["sliding_attention", "full_attention"])
    assert "sliding window of 512" in da.mask_needed_reason(gemma, 8192)
    assert da.varlen_unavailable_reason() is not None  # this CPU machine
