"""GPU memory of a run, estimated before anything is built: the ZeRO paper's model-state formulas, activations (with and
without recomputation and the fused loss), the ZeRO buckets, and each phase of a run (train step, evaluation, export,
the end-of-run sample). The plan (`planning/plan.py`) sizes the automatic micro-batch with it; the preflight compares it
with the GPU and names the cheapest configuration that fits."""

from __future__ import annotations

from dataclasses import dataclass

from model_utils.models.build import head_dim
from model_utils.models.evaluation import CHUNK_TOKENS
from model_utils.models.quantization import BYTES_PER_PARAM
from model_utils.models.speed import zero3_keeps_eager_layers
from model_utils.patches.liger import chunk_budget_in_force, logits_chunk_bytes

GIB = 1024**3
# The automatic micro-batch (`"train_micro_batch_size_per_gpu": "auto"`, `--micro_batch_size auto`) fills at most this
# share of the GPU by the estimate, which lands within 10% of every measured peak (docs/PERFORMANCE.md).
AUTO_MEMORY_SHARE = 0.90
# ...and holds at most this many tokens per micro-batch: larger ones gain no speed (docs/PERFORMANCE.md) and lengthen
# evaluation and compilation.
AUTO_MAX_MICRO_TOKENS = 65_536
# Eager decoder layers (ZeRO-3 with offload or LoRA, where they are not compiled, or --compile off) keep every
# intermediate of their forward for the backward: `eager_layer_activation_bytes_per_token` counts their 16-bit tensors,
# with this margin for the rest (the layers' fp32 statistics; beyond the layers, the fused loss's LM-head gradient and
# final hidden states and the backward's transients), fitted to the eager peaks measured (docs/PERFORMANCE.md): each
# lies within 5% of its estimate.
EAGER_ACTIVATION_MARGIN = 1.06
# --offload_activations keeps each saved tensor from this size on in a host buffer of its exact size (models/offload.py);
# below it, PyTorch's pinned allocator's rounding up to a power of two costs little and its cache serves tensors whose
# shapes vary (positions, masks, a packed batch's boundaries).
OFFLOAD_EXACT_BYTES = 64 * 1024**2
# Where no GPU memory is known (CPU runs; a login node without GPU_MEMORY_GIB): the micro-batch ds_config.json held.
AUTO_MICRO_WITHOUT_GPU = 8


@dataclass(frozen=True)
class QuantizedBase:
    """QLoRA's 4-bit base as the memory estimate counts it (models.quantization): the parameters stored in 4-bit, a part
    of the frozen ones, at BYTES_PER_PARAM each (the 4-bit values and the double-quantized absmax), and the largest of
    those weights, which a layer's matmul dequantizes into a working copy in the compute dtype (its forward and its
    backward pass each one matrix at a time)."""

    params: int
    largest: int

    def frozen_bytes(self, frozen_params: int, weight_bytes: int) -> float:
        """The frozen weights' bytes: those in 4-bit at BYTES_PER_PARAM, the rest (embeddings, norms, the LM head) at
        `weight_bytes` (2 in 16-bit, 4 in fp32)."""
        return weight_bytes * (frozen_params - self.params) + BYTES_PER_PARAM * self.params

    def working_bytes(self, bf16: bool) -> float:
        """One dequantized weight, the largest, in the compute dtype."""
        return self.largest * (2 if bf16 else 4)


def frozen_weight_bytes(frozen_params: int, weight_bytes: int, quantized: QuantizedBase | None) -> float:
    """The frozen weights' bytes: `weight_bytes` each, or those of a 4-bit base (QuantizedBase.frozen_bytes)."""
    return quantized.frozen_bytes(frozen_params, weight_bytes) if quantized else weight_bytes * frozen_params


@dataclass
class MemoryPlan:
    label: str
    zero_stage: int
    offload_optimizer: bool
    offload_param: bool
    micro_batch: int
    gradient_checkpointing: bool


def model_state_bytes(params: int, world: int, stage: int, offload_opt: bool, offload_param: bool, bf16: bool,
                      fp32_grad_accumulation: bool = False, gpu_optimizer_share: float = 0.0,
                      delayed_prefetch: bool = False, accumulation: int | None = None, frozen_params: int = 0,
                      whole_params: bool = False, quantized: QuantizedBase | None = None) -> float:
    """Per-GPU bytes of parameters, gradients and Adam state (Rajbhandari et al., mixed precision: 2+2+12 bytes/param)
    of the `params` that train; `frozen_params` (LoRA's frozen model) keep their 16-bit weight only, partitioned under
    ZeRO-3 and on the host where it offloads the parameters. `whole_params` (ZeRO-3 with every parameter persistent,
    config.deepspeed.keeps_whole_parameters): each GPU also keeps the whole 16-bit model beside its partition.
    `fp32_grad_accumulation` (ZeRO-1/2 with "data_types": {"grad_accum_dtype": "fp32"}): DeepSpeed accumulates each
    rank's gradient partition in an fp32 buffer on the GPU, also when the optimizer is offloaded (which then copies
    gradients to the CPU once per step instead of once per micro-batch). `gpu_optimizer_share`: the part of an
    offloaded optimizer a partial offload (ZeRO-3, `offload_optimizer.ratio`) keeps on the GPU, 16 bytes per
    parameter of it (fp32 master weights, Adam moments, fp32 gradients; config.deepspeed.gpu_optimizer_share).
    `delayed_prefetch`: the GPU copy of the rank's 16-bit partition that the delayed update prefetches the next
    weights into (ZeRO-1/2 with the optimizer offloaded; plan._prefetch_applies decides where it exists).
    `accumulation`: micro-batches per optimizer step (None: not known). With one, ZeRO-1/2's 16-bit gradients on the
    GPU are made during the backward as the layers free their activations, after the peak at its start, so they are
    not counted; with more, the earlier micro-batches' are held (docs/PERFORMANCE.md gives the measured peaks; the LM
    head's own is in activation_bytes's fused-loss term). `quantized`: QLoRA's 4-bit base, part of the frozen
    parameters (QuantizedBase)."""
    p_bytes, g_bytes, opt_bytes = (2, 2, 12) if bf16 else (4, 4, 8)
    weights = p_bytes * params + frozen_weight_bytes(frozen_params, p_bytes, quantized)
    params_b = weights / (world if stage >= 3 else 1)
    grads_b = g_bytes * params / (world if stage >= 2 else 1)
    if fp32_grad_accumulation and bf16 and stage in (1, 2):
        grads_b = 4 * params / world
    elif offload_opt:
        grads_b = 0  # they leave the GPU bucket by bucket (docs/PERFORMANCE.md)
    elif stage in (1, 2) and accumulation == 1:
        grads_b = 0
    opt_b = 0 if offload_opt else opt_bytes * params / (world if stage >= 1 else 1)
    if offload_param and stage == 3:
        params_b = 0
    if whole_params and stage == 3:
        params_b += weights
    if offload_opt and gpu_optimizer_share:
        opt_b += 16 * gpu_optimizer_share * params / (world if stage >= 1 else 1)
    if delayed_prefetch:
        opt_b += p_bytes * params / world
    return params_b + grads_b + opt_b


def _widths(config) -> tuple[int, int, int, int, int, int]:
    """h (hidden), q (the query's width), kv (the key's and the value's), I (the MLP's), and the query and key heads
    (0 for a model without attention heads, such as Mamba)."""
    dim = head_dim(config)
    heads = getattr(config, "num_attention_heads", None) or 0
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    # GPT-2's config names the MLP's width n_inner, None meaning 4 x hidden
    inter = getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) or 4 * config.hidden_size
    return config.hidden_size, heads * dim, kv_heads * dim, inter, heads, kv_heads


# Families whose attention normalises each head's query and key (RMSNorm over the head) before the rotary embedding:
# their layers keep the normed forms too.
QUERY_KEY_NORM_FAMILIES = frozenset({"qwen3", "qwen3_moe", "gemma3", "gemma3_text", "olmo2", "olmo3"})


def _query_key_norms(config) -> bool:
    return getattr(config, "model_type", "") in QUERY_KEY_NORM_FAMILIES


def _norm_and_attention_statistics(config) -> float:
    """fp32 bytes per token a layer keeps beside its 16-bit tensors, compiled or eager (measured in both): the
    attention's log-sum-exp per query head, one for each of the layer's norms and, in families with query and key
    norms, their statistic per query head and per key head. The compiled count adds them; the eager count's margin
    holds them."""
    _, _, _, _, heads, kv_heads = _widths(config)
    return 4 * (heads + 2 + (heads + kv_heads if _query_key_norms(config) else 0))


def _attention_tensors(config) -> int:
    """How many tensors of the query's width, and as many of the key's, a layer keeps: the projection, the rotated form
    and the attention's output (the value for the key's width), and the normed form where the family norms them."""
    return 3 if _query_key_norms(config) else 2


def layer_activation_bytes_per_token(config) -> float:
    """Bytes one compiled decoder layer keeps per token for its backward pass (flash attention; torch.compile's
    partitioner at the default --activation_budget 0.9 recomputes the rest), tensor by tensor: 16-bit, two of width h,
    two or three each of the query's width q and of the key's and value's kv (_attention_tensors), two of the MLP's I,
    and the fp32 statistics. benchmarks/layer_activations.py measures one layer; docs/PERFORMANCE.md sets each
    measured model beside this count."""
    h, q, kv, inter, _, _ = _widths(config)
    n = _attention_tensors(config)
    return 2 * (2 * h + n * (q + kv) + 2 * inter) + _norm_and_attention_statistics(config)


def eager_layer_activation_bytes_per_token(config) -> float:
    """Bytes one eager decoder layer keeps per token for its backward pass, its 16-bit tensors counted one by one, with
    EAGER_ACTIVATION_MARGIN for the rest: four of width h (the layer input and its norm, the residual after attention
    and its norm), those of q and kv a compiled layer keeps (_attention_tensors), three of I (gate, up and their
    product), and the same fp32 statistics as a compiled layer's. benchmarks/layer_activations.py measures one layer;
    docs/PERFORMANCE.md sets each measured model beside this count."""
    h, q, kv, inter, _, _ = _widths(config)
    n = _attention_tensors(config)
    return EAGER_ACTIVATION_MARGIN * 2 * (4 * h + n * (q + kv) + 3 * inter)


@dataclass(frozen=True)
class AdapterActivations:
    """One decoder layer's LoRA adapters as their activations scale (models.lora.adapter_activations reads them from the
    wrapped model): the sum of the adapted layers' input widths, the sum of their ranks, and whether dropout is on;
    `mlp_inputs` and `mlp_ranks`, the part of each sum inside the layer's MLP (gate, up and down on the families'
    default layers), which a tiled MLP recomputes tile by tile with the MLP's own tensors."""

    inputs: int
    ranks: int
    dropout: bool
    mlp_inputs: int = 0
    mlp_ranks: int = 0

    def bytes_per_token(self, compiled: bool, tiled_mlp: bool = False) -> float:
        """What the adapters add to one layer's kept activations per token: 4 bytes per rank element (A x, which B's
        gradient reads) and, with dropout, per input element 1 byte compiled (the mask: the layer's input is kept
        anyway and the dropped copy is recomputed from it) or 4 eager (the mask, the dropped 16-bit copy A's gradient
        reads, and what the eager layer keeps beside them). benchmarks/layer_activations.py --lora_rank measures them
        (docs/PERFORMANCE.md). `tiled_mlp`: without the MLP's adapters, which keep theirs for one tile only
        (mlp_bytes_per_token)."""
        ranks = self.ranks - self.mlp_ranks if tiled_mlp else self.ranks
        return self._per_input(compiled) * self._inputs(tiled_mlp) + 4 * ranks

    def backward_bytes_per_token(self, compiled: bool, tiled_mlp: bool = False) -> float:
        """What a compiled layer's backward pass holds beside its kept activations while it runs, per token: with
        dropout, each adapter's dropped 16-bit copy and its mask recomputed from the kept input (3 bytes per input
        element; the MLP's within its tiles where they are tiled). One layer's at a time. Eager layers keep both
        instead (bytes_per_token). Measured: the compiled LoRA runs' peaks above their kept activations, 27.8 GiB
        for llama-8b at 262,144 tokens and 2.4-2.7 GiB for Llama 3.2 1B's shape at 27-29 x 2048 (docs/PERFORMANCE.md)."""
        return 3 * self._inputs(tiled_mlp) if compiled and self.dropout else 0.0

    def mlp_bytes_per_token(self, compiled: bool) -> float:
        """The MLP's adapters' share of bytes_per_token: what a tiled MLP holds of them for one tile."""
        return self._per_input(compiled) * self.mlp_inputs + 4 * self.mlp_ranks

    def _per_input(self, compiled: bool) -> int:
        return (1 if compiled else 4) if self.dropout else 0

    def _inputs(self, tiled_mlp: bool) -> int:
        """The input elements per token whose activations span the sequence: all, or with tiled MLPs the attention's."""
        return self.inputs - self.mlp_inputs if tiled_mlp else self.inputs


def mlp_bytes_per_token(config, compiled: bool) -> float:
    """What a decoder layer's MLP adds to its kept activations per token: its 16-bit tensors of width I, two compiled
    (layer_activation_bytes_per_token), three eager with EAGER_ACTIVATION_MARGIN (eager_layer_...)."""
    inter = _widths(config)[3]
    return 2 * 2 * inter if compiled else EAGER_ACTIVATION_MARGIN * 2 * 3 * inter


def tiled_mlp_bytes(config, micro: int, seq_len: int, compiled: bool, gradients: bool = True,
                    adapters: AdapterActivations | None = None) -> float:
    """With tiled MLPs (--tiled_mlp, models.sequence_parallel.tile_mlps), the MLP keeps none of its tensors of width I
    for the backward pass, nor its LoRA `adapters`' (they run inside it): it recomputes them one tile at a time
    (~hidden-size tokens of each row), their values and, in training, their gradients. Those of one tile, the
    transient that replaces the layer's MLP share of its working set."""
    tile = min(seq_len, config.hidden_size)
    per_token = mlp_bytes_per_token(config, compiled) + (adapters.mlp_bytes_per_token(compiled) if adapters else 0.0)
    return (2 if gradients else 1) * micro * tile * per_token


def activation_bytes(config, seq_len: int, micro: int, checkpointing: bool, fused_ce: bool, bf16: bool,
                     chunk_budget: int, compiled: bool = True, checkpointed_layers: int | None = None,
                     adapters: AdapterActivations | None = None, offloaded: bool = False,
                     tiled_mlp: bool = False) -> float:
    """Activations kept for the backward pass (per layer and token: `layer_activation_bytes_per_token` compiled,
    `eager_layer_activation_bytes_per_token` eager, with LoRA's `adapters` added); a recomputed layer keeps only its
    input (2·s·b·h), and recomputing needs one layer's working set at a time. With `checkpointing`, the first
    `checkpointed_layers` layers recompute (None: all) and the rest keep their working sets; the backward pass frees
    those before it reaches a recomputed layer, so the peak holds the kept working sets or the one being recomputed,
    not both (docs/PERFORMANCE.md sets this beside measured peaks). Logits: 16-bit logits, their fp32 upcast and its
    gradient, unless the fused linear cross-entropy avoids them. `offloaded` (--offload_activations): the recomputed
    layers' inputs are in host memory. `tiled_mlp`: the MLPs, with their adapters, keep one tile's tensors
    (tiled_mlp_bytes), not the sequence's. With compiled LoRA layers, one layer's backward adds what it recomputes
    (AdapterActivations.backward_bytes_per_token)."""
    h, layers = config.hidden_size, config.num_hidden_layers
    scale = 1 if bf16 else 2
    # Eager layers keep more of their working set than compiled ones; a checkpointed layer's kept input is the same.
    per_token = layer_activation_bytes_per_token(config) if compiled else eager_layer_activation_bytes_per_token(config)
    if tiled_mlp:
        per_token -= mlp_bytes_per_token(config, compiled)
    working_set = micro * seq_len * (per_token + (adapters.bytes_per_token(compiled, tiled_mlp) if adapters else 0.0))
    if tiled_mlp:
        working_set += tiled_mlp_bytes(config, micro, seq_len, compiled, adapters=adapters)
    recomputed = min(layers, layers if checkpointed_layers is None else checkpointed_layers) if checkpointing else 0
    kept = layers - recomputed
    inputs = 0 if offloaded else recomputed * 2 * micro * seq_len * h
    backward = micro * seq_len * adapters.backward_bytes_per_token(compiled, tiled_mlp) if adapters else 0.0
    acts = inputs + max(kept, 1 if recomputed else 0) * working_set + backward
    # Fused: one chunk of transient 16-bit logits at the chunk budget in force (--flce_chunk_budget, lowered at long
    # sequences: patches.liger.chunk_budget_in_force), the budget's hidden-state sizes (the measured peaks' fit) or
    # Liger's chunk where its rounding makes that larger (patches.liger.logits_chunk_bytes). Beside
    # compiled layers, also what the fused loss's forward keeps for the backward: the LM head's 16-bit gradient and 8·h
    # bytes per token (benchmarks/layer_activations.py, exact for Qwen3-0.6B, 4B and 8B); beside eager layers their
    # margin (EAGER_ACTIVATION_MARGIN) holds it.
    tokens = micro * seq_len
    budget = chunk_budget_in_force(chunk_budget, tokens, h, config.vocab_size)
    logits = (max(budget * tokens * h * 2, logits_chunk_bytes(budget, tokens, h, config.vocab_size))
              + (2 * config.vocab_size * h + 8 * micro * seq_len * h if compiled else 0) if fused_ce
              else micro * seq_len * config.vocab_size * (2 + 4 + 4))
    return acts * scale + logits


# Beside the recomputed layers' inputs, --offload_activations moves what the model keeps after its last layer, tensors
# of as many values as a layer's input: with Liger's final norm and loss, the norm's input and the loss's gradient of
# the hidden states (34 buffers of one size at 360,448 tokens of Llama 3.1 8B's 32 layers); with PyTorch's RMSNorm as
# the final norm (beside compiled layers, Liger's loss alone), its fp32 input, saved twice, and its 16-bit output instead
# of the input: four more in 16-bit sizes (transformers' RMSNorm; the compiled run's host peak lay 6.2 GiB above the
# eager one's at 262,144 tokens, three of them: the count errs above). Without the fused loss, its fp32 log-probabilities
# over the vocabulary besides.
OFFLOADED_AFTER_THE_LAYERS = 2
OFFLOADED_BY_TORCH_FINAL_NORM = 4


def offloaded_activation_bytes(config, seq_len: int, micro: int, recomputed_layers: int, bf16: bool,
                               torch_final_norm: bool = False, fused_loss: bool = True) -> float:
    """Host memory of one rank's offloaded activations (--offload_activations): each recomputed layer's input, micro x
    seq_len x hidden values in 16-bit (fp32 without bf16), and those of their size after the last layer
    (OFFLOADED_AFTER_THE_LAYERS, with `torch_final_norm` OFFLOADED_BY_TORCH_FINAL_NORM more; without the `fused_loss`,
    the loss's fp32 log-probabilities), each in a buffer of its exact size from OFFLOAD_EXACT_BYTES on, below it as
    pinned_bytes counts it."""
    nbytes = micro * seq_len * config.hidden_size * (2 if bf16 else 4)
    count = recomputed_layers + OFFLOADED_AFTER_THE_LAYERS + (OFFLOADED_BY_TORCH_FINAL_NORM if torch_final_norm else 0)
    logits = 0 if fused_loss else micro * seq_len * config.vocab_size * 4
    exact = lambda size: size if size >= OFFLOAD_EXACT_BYTES else pinned_bytes(size)  # noqa: E731
    return count * exact(nbytes) + (exact(logits) if logits else 0)


def pinned_bytes(nbytes: int) -> int:
    """What one pinned host allocation of `nbytes` takes from PyTorch's caching host allocator: it rounds it up to the
    next power of two (docs/PERFORMANCE.md, Checkpoint saves, measures it)."""
    return 1 << (int(nbytes) - 1).bit_length() if nbytes > 1 else int(nbytes)


def evaluation_bytes(config, seq_len: int, micro: int, bf16: bool, tiled_mlp: bool = False) -> float:
    """Evaluation's working memory beyond the model states (model_utils.models.evaluation): a forward without gradients
    keeps one layer's working set (its MLP's for one tile with `tiled_mlp`), the final hidden states, and one chunk of
    logits (16-bit, their fp32 upcast and the cross-entropy's log-probabilities), never the whole batch's."""
    h, scale = config.hidden_size, 1 if bf16 else 2
    per_token = layer_activation_bytes_per_token(config)
    tile = 0.0
    if tiled_mlp:
        per_token -= mlp_bytes_per_token(config, compiled=True)
        tile = tiled_mlp_bytes(config, micro, seq_len, compiled=True, gradients=False)
    layer = (micro * seq_len * per_token + tile) * scale
    return layer + micro * seq_len * h * 2 * scale + min(CHUNK_TOKENS, micro * seq_len) * config.vocab_size * 10


def largest_parameter_bytes(config, bf16: bool) -> float:
    """The largest single parameter, the embedding or the LM head: what a ZeRO-3 export gathers on a GPU at once, and
    the size of the GPU buffer ZeRO-1/2 keep for one gradient with the optimizer offloaded (bucket_bytes)."""
    return config.vocab_size * config.hidden_size * (2 if bf16 else 4)


@dataclass
class PhaseMemory:
    """Estimated peak bytes per GPU in each phase of a run; the run needs the largest."""

    train: float
    evaluation: float
    export: float
    generation: float

    @property
    def peak(self) -> tuple[str, float]:
        return max(vars(self).items(), key=lambda item: item[1])


def phase_memory(num_params: int, mconf, world: int, seq_len: int, micro: int, stage: int, off_opt: bool,
                 off_par: bool, bf16: bool, zero: dict, checkpointing: bool, fused: bool, chunk: int,
                 generate: bool, fp32_grad_accumulation: bool = False, compiled: bool = True,
                 gpu_optimizer_share: float = 0.0, checkpointed_layers: int | None = None,
                 delayed_prefetch: bool = False, accumulation: int | None = None,
                 frozen_params: int = 0, adapters: AdapterActivations | None = None,
                 whole_params: bool = False, offloaded_activations: bool = False,
                 tiled_mlp: bool = False, quantized: QuantizedBase | None = None) -> PhaseMemory:
    """`num_params`: the parameters that train (weight, gradient, optimizer state each); `frozen_params`: those that
    do not (LoRA's frozen model: their 16-bit weight only, partitioned under ZeRO-3); `adapters`: LoRA's, per layer;
    `whole_params`: ZeRO-3 keeps every parameter whole on each GPU (model_state_bytes); `quantized`: QLoRA's 4-bit
    base, whose dequantized working copy the train step and the evaluation hold beside the rest."""
    states = model_state_bytes(num_params, world, stage, off_opt, off_par, bf16, fp32_grad_accumulation,
                               gpu_optimizer_share, delayed_prefetch, accumulation, frozen_params, whole_params,
                               quantized)
    working = quantized.working_bytes(bf16) if quantized else 0.0
    return PhaseMemory(
        train=states + bucket_bytes(zero, stage, off_opt, bf16, largest_parameter_bytes(mconf, bf16))
        + activation_bytes(mconf, seq_len, micro, checkpointing, fused, bf16, chunk, compiled, checkpointed_layers,
                           adapters, offloaded_activations, tiled_mlp) + working,
        evaluation=states + evaluation_bytes(mconf, seq_len, micro, bf16, tiled_mlp) + working,
        export=states + (largest_parameter_bytes(mconf, bf16) if stage == 3 else 0.0),
        # rank 0 loads the exported model (16-bit) for --generate_prompt while the engine still holds its states
        generation=states + (num_params + frozen_params) * 2 if generate else 0.0)


def bucket_bytes(zero: dict, stage: int, offload_optimizer: bool, bf16: bool,
                 largest_param_bytes: float = 0.0) -> float:
    """ZeRO-1/2 gradient reduction buckets: reduce_bucket_size elements of the gradients' dtype, doubled with
    overlap_comm (none under ZeRO-3); with the optimizer offloaded, also DeepSpeed's GPU buffer for one gradient the
    size of the largest parameter (`largest_param_bytes`, 16-bit: the embedding or the LM head), allocated once for the
    copies to the host. `zero` is the zero_optimization section."""
    elements = zero.get("reduce_bucket_size", 5e8)
    if stage not in (1, 2) or not isinstance(elements, (int, float)):
        return 0.0
    buckets = float(elements) * (2 if bf16 else 4) * (2 if zero.get("overlap_comm") else 1)
    return buckets + (largest_param_bytes if offload_optimizer else 0.0)


def cheapest_fit(params, mconf, world, seq_len, micro, bf16, fused, chunk, memory_gib, zero: dict,
                 compiled: bool = True, host_available: float | None = None, ranks_per_node: int = 1,
                 adapters: AdapterActivations | None = None, frozen_params: int = 0,
                 quantized: QuantizedBase | None = None) -> str:
    """The first configuration, in order of speed, whose estimate fits in 92% of the GPU and, for those that offload,
    whose host part fits `host_available` (this node's free memory; None where unknown, as on a login node: the
    offloading ones then name their host need). `params` train, `frozen_params` do not (LoRA's frozen model: their
    16-bit weight only, on the host where ZeRO-3 offloads the parameters). `compiled`: the layers compile where ZeRO-3
    does not keep them eager (models.speed.zero3_keeps_eager_layers); `adapters`: LoRA's, per layer (None: no LoRA);
    `quantized`: QLoRA's 4-bit base (its layers run eager)."""
    candidates = []
    m = micro
    while m > 1:
        m //= 2
        candidates.append(MemoryPlan(f"train_micro_batch_size_per_gpu {m} (--global_batch_tokens keeps the batch; or "
                                     f"\"auto\")", 2, False, False, m, False))
    candidates += [MemoryPlan("--gradient_checkpointing", 2, False, False, micro, True),
                   MemoryPlan("--gradient_checkpointing with micro-batch 1", 2, False, False, 1, True),
                   MemoryPlan("DS_CONFIG=configs/zero3.json with --gradient_checkpointing", 3, False, False, micro, True),
                   MemoryPlan("DS_CONFIG=configs/zero2-offload.json with --gradient_checkpointing", 2, True, False, micro, True),
                   MemoryPlan("DS_CONFIG=configs/zero3-offload.json with --gradient_checkpointing and micro-batch 1",
                              3, True, True, 1, True)]
    skipped_for_host = False
    for plan in candidates:
        # configs/zero2-offload.json accumulates gradients in fp32 on the GPU
        fp32_accumulation = plan.offload_optimizer and plan.zero_stage == 2
        need = (model_state_bytes(params, world, plan.zero_stage, plan.offload_optimizer, plan.offload_param, bf16,
                                  fp32_accumulation, frozen_params=frozen_params, quantized=quantized)
                + bucket_bytes(zero, plan.zero_stage, plan.offload_optimizer, bf16,
                               largest_parameter_bytes(mconf, bf16))
                + activation_bytes(mconf, seq_len, plan.micro_batch, plan.gradient_checkpointing, fused, bf16, chunk,
                                   compiled and quantized is None and not zero3_keeps_eager_layers(
                                       plan.zero_stage, plan.offload_optimizer or plan.offload_param,
                                       adapters is not None), adapters=adapters)
                + (quantized.working_bytes(bf16) if quantized else 0.0))
        if need > 0.92 * memory_gib * GIB:
            continue
        host = offload_host_bytes(params, world, ranks_per_node, plan.zero_stage, plan.offload_optimizer,
                                  plan.offload_param, fp32_accumulation, frozen_params=frozen_params,
                                  quantized=quantized)
        if host_available is not None and host > host_available:
            skipped_for_host = True
            continue
        return (f"cheapest configuration that fits (~{need / GIB:.0f} GiB"
                + (f", and ~{host / GIB:.0f} GiB of host memory per node" if host else "") + f"): {plan.label}")
    return ("nothing fits on this many GPUs" + (" with this node's memory for offloaded states" if skipped_for_host
                                                else "")
            + ": use more GPUs (ZeRO-3 divides the model states by their number)")


# Host memory of a rank that offloads: its share of the optimizer states (fp32 master weights, Adam moments, fp32
# gradients: 16 bytes per parameter), 10% for pinned-buffer rounding, and what any training process holds (CUDA context,
# libraries, compiled kernels, the data); docs/PERFORMANCE.md sets the estimates beside measured host peaks.
HOST_STATE_OVERHEAD = 1.10
HOST_BASELINE_GIB = 8.0
# Loading a checkpoint with the optimizer offloaded holds about one fp32 copy of the rank's parameters beside the
# offloaded states (measured in docs/JOURNEY-FINE-TUNING.md's *-large-resume journeys). Not measured with part of the optimizer on
# the GPU (offload_optimizer.ratio).
RESUME_HOST_BYTES_PER_PARAM = 4.0


def resume_host_bytes(params: int, world: int, ranks_per_node: int, offload_opt: bool,
                      gpu_optimizer_share: float = 0.0) -> float:
    """Host memory a node needs beyond `offload_host_bytes` while its ranks load a checkpoint (0 where not measured)."""
    if not offload_opt or gpu_optimizer_share > 0:
        return 0.0
    return RESUME_HOST_BYTES_PER_PARAM * params / world * ranks_per_node


def offload_host_bytes(params: int, world: int, ranks_per_node: int, stage: int, offload_opt: bool,
                       offload_param: bool, fp32_grad_accumulation: bool, gpu: bool = True,
                       gpu_optimizer_share: float = 0.0, pinned_optimizer: bool = True,
                       frozen_params: int = 0, quantized: QuantizedBase | None = None) -> float:
    """Host memory one node needs for its ranks' offloaded states (0 without offload). ZeRO-1/2 without the GPU's fp32
    accumulation buffer also keeps each rank's 16-bit gradient accumulation in host memory; ZeRO-3 with the optimizer
    offloaded keeps its gradient accumulation buffer there (pinned, in grad_accum_dtype, for every parameter of the
    rank's partition, also under a partial offload: DeepSpeed's stage3 allocates it on the optimizer's device); ZeRO-3's
    offloaded parameters add their 16-bit share, `frozen_params` (LoRA's frozen model) theirs too; a partial offload
    leaves `gpu_optimizer_share` of the optimizer on the GPU, but DeepSpeed creates that part's fp32 gradient buffers
    in pinned host memory before moving them to the GPU (`pinned_optimizer`: offload_optimizer.pin_memory), and
    PyTorch's pinned-memory cache keeps what they took (4 bytes per parameter of the GPU part; docs/PERFORMANCE.md has
    the measurements). `gpu` False: CPU ranks, whose processes hold no CUDA context (1 GiB each). `quantized`: QLoRA's
    4-bit base (QuantizedBase), part of the frozen parameters."""
    if not (offload_opt or offload_param):
        return 0.0
    per_param = 16.0 * (1 - gpu_optimizer_share) if offload_opt else 0.0
    if offload_opt and stage in (1, 2) and not fp32_grad_accumulation:
        per_param += 2
    if offload_opt and stage == 3:
        per_param += 4 if fp32_grad_accumulation else 2
    offloaded_weights = offload_param and stage == 3  # 16-bit, of the parameters that train and of the frozen ones
    if offloaded_weights:
        per_param += 2
    if offload_opt and stage == 3 and pinned_optimizer:
        per_param += 4 * gpu_optimizer_share
    frozen = frozen_weight_bytes(frozen_params, 2, quantized) if offloaded_weights else 0
    per_rank = (per_param * params + frozen) / world * HOST_STATE_OVERHEAD + (HOST_BASELINE_GIB if gpu else 1.0) * GIB
    return per_rank * ranks_per_node


def choose_micro_batch(seq_len: int, memory_gib: float | None, peak_bytes, allowed) -> tuple[int, str]:
    """The automatic micro-batch: the largest one `allowed` (it divides the global batch) whose estimated peak
    (`peak_bytes(micro)`, every phase of the run) fits in AUTO_MEMORY_SHARE of the GPU, capped at
    AUTO_MAX_MICRO_TOKENS tokens. Returns (micro, why) for the run header; micro 1 when none fits (the preflight then
    reports the memory problem and the cheapest fix)."""
    if memory_gib is None:
        micro = max((m for m in range(1, AUTO_MICRO_WITHOUT_GPU + 1) if allowed(m)), default=1)
        return micro, (f"auto: {micro} (no GPU memory known here: the default; a run on GPUs sizes it by their "
                       "memory, GPU_MEMORY_GIB=N plans for them)")
    cap = max(1, AUTO_MAX_MICRO_TOKENS // seq_len)
    budget = AUTO_MEMORY_SHARE * memory_gib * GIB
    larger = None  # the smallest allowed micro-batch above the choice, with its estimate
    for micro in range(cap, 0, -1):
        if not allowed(micro):
            continue
        need = peak_bytes(micro)
        if need <= budget:
            capped = f" (and the cap, {AUTO_MAX_MICRO_TOKENS:,} tokens per micro-batch)" if micro == cap else ""
            # A larger one that fits the GPU past the headroom can be faster (fewer micro-batches a step): say so.
            closer = (f"; {larger[0]} needs ~{larger[1] / GIB:.1f} GiB, within the GPU but not its headroom: "
                      f"--micro_batch_size {larger[0]} takes it" if larger and larger[1] <= memory_gib * GIB else "")
            return micro, (f"auto: {micro}, ~{need / GIB:.1f} GiB estimated, the largest that fits "
                           f"{AUTO_MEMORY_SHARE:.0%} of {memory_gib:.0f} GiB{capped}{closer}")
        larger = (micro, need)
    return 1, f"auto: 1 (nothing fits {AUTO_MEMORY_SHARE:.0%} of {memory_gib:.0f} GiB by the estimate)"
