"""Long sequences: DeepSpeed's Arctic Long Sequence Training (ALST) pieces, through their public API.

- Sequence parallelism (`--sequence_parallel N`): DeepSpeed's `UlyssesSPAttentionHF` wraps the model's attention. Each
  of N consecutive ranks holds a slice of every sequence; around attention an all-to-all trades the slices of the
  sequence for slices of the heads, so each rank attends over the whole sequence for 1/N of the heads. Everything else
  (embeddings, MLPs, norms, the loss) runs on the rank's slice alone.
- The attention under it sees the whole sequence: FlashAttention-4 with the documents' or examples' boundaries where it
  runs, else PyTorch's variable-length FlashAttention (from Ampere on) or SDPA once per document
  (models.document_attention: causal within each, never a dense mask). It is registered with
  transformers under its own name without a mask function, so transformers builds no mask for the rank's slice either
  (a packed slice of 64K tokens would otherwise get a 4 GiB boolean mask that Ulysses throws away).
- Tiled MLPs (`--tiled_mlp`): DeepSpeed's `TiledMLP` runs each decoder layer's MLP over the sequence in tiles and
  recomputes it in the backward pass, so the MLP's intermediate activations exist for one tile at a time.

The data side needs no DeepSpeed adapter: every rank of a group reads the same blocks (runtime.distributed.Dist
.data_rank) and keeps its slice (`shard_inputs`), so the data order and the resume point are those of a run whose data
parallelism is the number of groups.
"""

from __future__ import annotations

import inspect
import math

from model_utils.core.problems import Problem
from model_utils.models.document_attention import KERNEL_LABELS, document_attention_function
from model_utils.patches.flash_attn4 import FA4_NAME, fa4_attention

ULYSSES_NAME = "dslm_ulysses"  # the attention implementation name registered with transformers under Ulysses
TILED_MLP_MIN_TOKENS = 32768  # --tiled_mlp auto: on where a GPU holds at least this many tokens of a sequence


def sequence_parallel_problems(config, sequence_parallel: int, seq_len: int, gpus: int,
                               attn_implementation: str) -> list[Problem]:
    """Why `--sequence_parallel` cannot split this model's sequences on `gpus` ranks, each with the fix."""
    n = sequence_parallel
    if n == 1:
        return []
    problems = []
    if gpus % n:
        problems.append(Problem("--sequence_parallel", n, f"does not divide the {gpus} GPUs of the run",
                                f"use a divisor of {gpus} (data parallelism runs over GPUs / N groups)"))
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if heads % n:
        fits = [d for d in range(2, heads + 1) if heads % d == 0 and (kv_heads % d == 0 or d % kv_heads == 0)]
        problems.append(Problem("--sequence_parallel", n, f"does not divide the model's {heads} attention heads "
                                "(each rank attends with heads / N of them)", f"use one of {fits[:6]}"))
    elif kv_heads % n and n % kv_heads:
        problems.append(Problem("--sequence_parallel", n, f"and the model's {kv_heads} key-value heads do not divide "
                                "one another", f"use a divisor or a multiple of {kv_heads}"))
    if seq_len % n:
        problems.append(Problem("--seq_len", seq_len, f"is not a multiple of --sequence_parallel {n} (each rank holds "
                                "an equal slice)", f"use {seq_len // n * n} or {math.ceil(seq_len / n) * n}"))
    if not ulysses_takes_a_model():
        import deepspeed

        problems.append(Problem("--sequence_parallel", n, f"needs a DeepSpeed whose Ulysses takes a loaded model "
                                f"(0.19.8 does; {deepspeed.__version__} here loads the model's config by hub name)",
                                "pip install 'deepspeed>=0.19.8'"))
    if attn_implementation not in ("sdpa", "flash_attention_2", "flash_attention_3"):
        problems.append(Problem("--attn_implementation", attn_implementation, "is not supported with "
                                "--sequence_parallel (Ulysses needs attention that takes no dense mask)",
                                "use --attn_implementation sdpa (FlashAttention-4 is used where it runs)"))
    return problems


def ulysses_takes_a_model() -> bool:
    """Whether this DeepSpeed's UlyssesSPAttentionHF.register_with_transformers takes the loaded model (it names the
    length `seq_length` since then); True where DeepSpeed is not importable here (a login node's preflight)."""
    try:
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    except ImportError:
        return True
    return "seq_length" in inspect.signature(UlyssesSPAttentionHF.register_with_transformers).parameters


def uses_tiled_mlp(setting: str, seq_len: int, sequence_parallel: int) -> bool:
    """--tiled_mlp: on, off, or auto (on where a GPU holds TILED_MLP_MIN_TOKENS tokens of a sequence or more)."""
    if setting == "auto":
        return seq_len // sequence_parallel >= TILED_MLP_MIN_TOKENS
    return setting == "on"


# ----------------------------------------------------------------------------------------------------------------------
# Attention over the whole sequence, within documents
# ----------------------------------------------------------------------------------------------------------------------
def enable_ulysses(model, sequence_parallel: int, micro_batch: int, seq_len: int, log):
    """Wrap the model's attention in DeepSpeed's Ulysses for groups of `sequence_parallel` ranks and return the
    parallel-state object (mpu) that deepspeed.initialize takes. Call after the speed options (which pick
    FlashAttention-4 or SDPA) and before deepspeed.initialize."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from transformers import AttentionInterface

    if getattr(model.config, "_attn_implementation", None) == FA4_NAME:
        kernel, core = "fa4", fa4_attention
    else:
        kernel, core = document_attention_function()
    AttentionInterface.register(ULYSSES_NAME, core)
    model.set_attn_implementation(ULYSSES_NAME)  # transformers' public setter: the model and every submodule
    # a variable length (evaluation's blocks may be shorter): only the micro-batch shapes Ulysses' checks
    mpu = UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=model, core_attn_implementation=ULYSSES_NAME, sequence_parallel_size=sequence_parallel,
        micro_batch_size=micro_batch, seq_length=seq_len, seq_length_is_variable=True)
    log(f"sequence parallelism: each sequence split across {sequence_parallel} GPUs (DeepSpeed Ulysses all-to-all "
        f"around {KERNEL_LABELS[kernel]})")
    return mpu


def shard_inputs(batch: dict, rank: int, sequence_parallel: int) -> dict:
    """This rank's slice of every per-token tensor of the model's inputs (batch, seq): tokens, targets and positions
    keep the whole sequence's values (targets were shifted before the split, positions count from each document's
    start), so the slices together are the sequence. The documents' boundaries stay whole: the attention sees the
    whole sequence."""
    seq = batch["input_ids"].shape[1]
    width = seq // sequence_parallel
    sliced = {}
    for name, value in batch.items():
        if name in ("input_ids", "labels", "shift_labels", "position_ids"):
            value = value[:, rank * width:(rank + 1) * width].contiguous()
        sliced[name] = value
    return sliced


# ----------------------------------------------------------------------------------------------------------------------
# Tiled MLPs
# ----------------------------------------------------------------------------------------------------------------------
def tile_mlps(model, log) -> int:
    """Each decoder layer's MLP through DeepSpeed's TiledMLP (tiles of about hidden-size tokens, ALST's choice; the
    MLP recomputed in the backward pass). Returns the number of MLPs tiled."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    base = getattr(model, getattr(model, "base_model_prefix", "model"), model)
    layers = getattr(base, "layers", None) or []
    hidden = model.config.hidden_size
    tiled = 0
    for layer in layers:
        mlp = getattr(layer, "mlp", None)
        if mlp is None:
            continue
        mlp.forward = _tiled_forward(mlp, mlp.forward, hidden, TiledMLP)
        tiled += 1
    if tiled:
        log(f"tiled MLP: {tiled} decoder layers' MLPs run in tiles of ~{hidden:,} tokens and recompute in the backward "
            "pass (DeepSpeed TiledMLP)")
    return tiled


def _tiled_forward(mlp, forward, hidden: int, tiled_mlp):
    """`mlp.forward` through `tiled_mlp` (TiledMLP): the parameters it computes gradients for are read at each call, so
    adapters added after tiling (LoRA's) are among them (DeepSpeed then reduces their gradients once, after the last
    tile); where a dropout is active (LoRA's), each tile's recomputation in the backward pass draws the random
    numbers its forward drew, so the gradients are those of the output the forward gave."""
    import torch

    from model_utils.runtime.process import rng_state, set_rng_state

    tile_rng: list = []  # the random-number state before each tile of the latest forward, while a dropout is active

    def tile_forward(module, tile):
        if not torch.is_grad_enabled():  # TiledMLP's forward (its backward recomputes with gradients enabled)
            if dropout_active():
                tile_rng.append(rng_state())
            return forward(tile)
        if not tile_rng:
            return forward(tile)
        now = rng_state()  # the numbers drawn after this recomputation stay those the run would draw without it
        set_rng_state(tile_rng.pop(0))
        try:
            return forward(tile)
        finally:
            set_rng_state(now)

    def dropout_active() -> bool:
        return mlp.training and any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in mlp.modules())

    def tiled(x):
        # The tokens of the micro-batch in one row: TiledMLP's forward cuts the next-to-last dimension into tiles and
        # its backward the flattened tokens, which are the same tiles only for a single row.
        tokens = x.reshape(-1, x.shape[-1])
        tiles = max(1, math.ceil(tokens.shape[0] / hidden))
        tile_rng.clear()  # a new forward (a checkpointed layer's recomputation draws the same numbers again)
        params = [p for p in mlp.parameters() if p.requires_grad]
        return tiled_mlp.apply(tile_forward, mlp, tokens, tiles, params).view(*x.shape[:-1], -1)

    return torch.compiler.disable(tiled)  # an autograd function running a backward inside its backward: eager
