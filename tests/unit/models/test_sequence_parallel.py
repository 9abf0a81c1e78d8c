"""The long-sequence pieces on CPU (models/sequence_parallel.py; the offload and RoPE scaling of models/build.py): the
tiled MLPs against the MLPs, each rank's slice of the inputs, what --sequence_parallel refuses, what
--offload_activations needs, the scaled RoPE (the offload itself: test_offload.py). The attention under Ulysses (models/document_attention.py) is held against
transformers' dense-mask SDPA in test_document_attention.py; the split runs (2 gloo ranks) are in
tests/distributed/test_sequence_parallel_runs.py."""

from __future__ import annotations

import types

import pytest
import torch

from model_utils.config.flags import parse_args
from model_utils.models import sequence_parallel as sp
from model_utils.runtime.distributed import Dist


def test_each_rank_keeps_its_slice_of_every_per_token_input():
    inputs = {"input_ids": torch.arange(16).view(2, 8), "labels": torch.arange(16).view(2, 8) + 100,
              "shift_labels": torch.arange(16).view(2, 8) + 200, "position_ids": torch.arange(8).repeat(2, 1),
              "cu_seq_lens_q": torch.tensor([0, 8, 16]), "max_length_q": 8}
    first, second = (sp.shard_inputs(inputs, rank, 2) for rank in (0, 1))
    assert first["input_ids"].tolist() == [[0, 1, 2, 3], [8, 9, 10, 11]]
    assert second["position_ids"].tolist() == [[4, 5, 6, 7], [4, 5, 6, 7]]  # the whole sequence's positions
    assert second["shift_labels"].tolist() == [[204, 205, 206, 207], [212, 213, 214, 215]]
    assert second["cu_seq_lens_q"] is inputs["cu_seq_lens_q"] and second["max_length_q"] == 8  # attention: whole
    assert all(t.is_contiguous() for t in second.values() if torch.is_tensor(t))


def test_a_sequence_parallel_groups_ranks_read_the_same_blocks():
    ranks = [Dist(r, r, 4, torch.device("cpu"), "gloo", sequence_parallel=2) for r in range(4)]
    assert [(d.data_rank, d.sequence_rank, d.data_world) for d in ranks] == [(0, 0, 2), (0, 1, 2), (1, 0, 2), (1, 1, 2)]
    alone = Dist(3, 3, 4, torch.device("cpu"), "gloo")
    assert (alone.data_rank, alone.sequence_rank, alone.data_world) == (3, 0, 4)


def test_tiled_mlps_give_the_mlps_outputs_and_gradients():
    """Tiled MLPs against untiled ones, outputs and gradients of a whole model in float64 (the comparison exact to
    rounding): ~10 s on 2 cores, float64 matmuls of 1,200 positions forward and backward, twice."""
    from model_utils.data.tokenizer import load_tokenizer
    from model_utils.models.build import build_model, model_config

    torch.manual_seed(0)
    model = build_model("tiny", model_config("tiny", load_tokenizer(None)), torch.float64, "sdpa", False)
    tokens = torch.randint(0, 500, (2, 600))
    reference = model(input_ids=tokens, labels=tokens)
    reference.loss.backward()
    want = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    lines = []
    assert sp.tile_mlps(model, lines.append) == 4
    assert "tiles of ~192 tokens" in lines[0]  # the hidden size: 600 tokens in 4 tiles
    tiled = model(input_ids=tokens, labels=tokens)
    tiled.loss.backward()
    torch.testing.assert_close(tiled.loss, reference.loss, rtol=1e-10, atol=0)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[name], rtol=1e-8, atol=1e-12, msg=name)


def test_tiled_mlps_train_lora_adapters_added_after_them_with_their_dropout():
    """The trainer tiles the MLPs, then adds LoRA's adapters: TiledMLP takes the adapters as the parameters it computes
    gradients for (read at each call, not at tiling: DeepSpeed reduces them once, after the last tile), and each tile's
    recomputation in the backward pass draws the dropout masks its forward drew, at micro-batch 2 too. The reference:
    the same tiles run in one autograd graph (no recomputation) from the same random state: the same loss, the same
    adapter gradients."""
    from model_utils.config.settings import LoraSettings
    from model_utils.data.tokenizer import load_tokenizer
    from model_utils.models.build import build_model, model_config
    from model_utils.models.lora import apply_lora

    def in_tiles(mlp):  # the tiles TiledMLP makes (the micro-batch's tokens in one row), kept in the graph
        forward = mlp.forward
        mlp.forward = lambda x: torch.cat([forward(t) for t in x.reshape(-1, x.shape[-1]).chunk(7)]).view(
            *x.shape[:-1], -1)

    def run(tiled: bool):
        torch.manual_seed(0)
        model = build_model("tiny", model_config("tiny", load_tokenizer(None)), torch.float64, "sdpa", False)
        if tiled:
            sp.tile_mlps(model, lambda line: None)  # 1,200 tokens in tiles of ~192: 7 tiles
        else:
            for layer in model.model.layers:
                in_tiles(layer.mlp)
        model = apply_lora(model, LoraSettings(rank=4, alpha=8.0, dropout=0.3))
        for name, p in model.named_parameters():  # B starts at zero: move it so that A's gradient is not zero
            if "lora_B" in name:
                torch.nn.init.normal_(p.data)
        model.train()
        tokens = torch.randint(0, 500, (2, 600))
        torch.manual_seed(1)
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        return model, loss, {n: p.grad for n, p in model.named_parameters() if p.requires_grad}

    (_, want_loss, want), (model, loss, grads) = run(False), run(True)
    assert want.keys() == grads.keys() and any("mlp.down_proj.lora_A" in n for n in grads)
    torch.testing.assert_close(loss, want_loss, rtol=1e-12, atol=0)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, want[name], rtol=1e-8, atol=1e-12, msg=name)
    mlp_adapters = [p for n, p in model.named_parameters() if ".mlp." in n and "lora_" in n]
    assert mlp_adapters and all(p.ds_grad_is_ready for p in mlp_adapters)  # TiledMLP handled them as its parameters


def test_tiled_mlps_by_default_where_a_gpu_holds_32k_tokens_of_a_sequence():
    assert not sp.uses_tiled_mlp("auto", 32768, 2) and sp.uses_tiled_mlp("auto", 65536, 2)
    assert sp.uses_tiled_mlp("on", 256, 1) and not sp.uses_tiled_mlp("off", 10**6, 1)


@pytest.mark.parametrize(("split", "seq_len", "gpus", "attn", "says"), [
    (3, 96, 6, "sdpa", "does not divide the model's 4 attention heads"),
    (2, 96, 3, "sdpa", "does not divide the 3 GPUs of the run"),
    (4, 90, 4, "sdpa", "--seq_len = 90: is not a multiple of --sequence_parallel 4"),
    (2, 96, 2, "eager", "--attn_implementation = eager"),
])
def test_sequence_parallel_refuses_what_it_cannot_split(split, seq_len, gpus, attn, says):
    config = types.SimpleNamespace(num_attention_heads=4, num_key_value_heads=2)
    problems = sp.sequence_parallel_problems(config, split, seq_len, gpus, attn)
    assert len(problems) == 1 and says in str(problems[0]), problems
    assert problems[0].fix
    assert sp.sequence_parallel_problems(config, 2, 96, 4, "sdpa") == []
    assert sp.sequence_parallel_problems(config, 1, 91, 3, "eager") == []


def test_the_flag_and_its_help():
    cfg = parse_args(["--sequence_parallel", "2", "--tiled_mlp", "on"])
    assert (cfg.model.sequence_parallel, cfg.model.tiled_mlp) == (2, "on")
    assert parse_args([]).model.sequence_parallel == 1


# ----------------------------------------------------------------------------------------------------------------------
# Memory at length: what offloading the layers' inputs needs; RoPE past the model's positions
# ----------------------------------------------------------------------------------------------------------------------
def test_offload_activations_needs_gradient_checkpointing():
    from model_utils.config.checks import validate_args

    problems = validate_args(parse_args(["--offload_activations"]))
    assert [p.setting for p in problems] == ["--offload_activations"]
    assert validate_args(parse_args(["--offload_activations", "--gradient_checkpointing"])) == []


def test_rope_scaling_multiplies_the_positions_and_is_recorded_in_the_config():
    from transformers import LlamaConfig

    from model_utils.models.build import model_config, rope_problem, scale_rope

    config = model_config("llama-1b", rope_scaling="yarn:2")
    assert config.max_position_embeddings == 262144
    assert config.rope_parameters == {"rope_type": "yarn", "factor": 2.0, "rope_theta": 500000.0,
                                      "original_max_position_embeddings": 131072}
    assert model_config("llama-1b").max_position_embeddings == 131072
    scaled = LlamaConfig(max_position_embeddings=131072, rope_parameters={
        "rope_type": "llama3", "factor": 8.0, "rope_theta": 5e5, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192})
    problem = rope_problem(scaled, "linear:2")
    assert problem is not None and "rope_type 'llama3'" in problem.message and "config.json" in problem.fix
    with pytest.raises(SystemExit):
        parse_args(["--rope_scaling", "dynamic:2"])  # scales at inference only
    with pytest.raises(SystemExit):
        parse_args(["--rope_scaling", "yarn:1"])
    assert parse_args(["--rope_scaling", "linear:4"]).model.rope_scaling == "linear:4"
    plain = LlamaConfig(max_position_embeddings=4096, rope_theta=10000.0)
    scale_rope(plain, "linear:4")
    assert plain.max_position_embeddings == 16384 and plain.rope_parameters["factor"] == 4.0
