"""One optimizer step: the model's inputs from packed blocks or examples, the forward and backward of each micro-batch
(weighted by its loss tokens for fine-tuning examples), DeepSpeed's update, and the one collective every rank agrees
on after it. The loop and benchmarks/bench.py both call `train_step` and `agree_after_step`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np
import torch

from model_utils.data.blocks import attention_area as document_area
from model_utils.data.blocks import document_boundaries, document_positions
from model_utils.data.custom.dataset import UserBatch
from model_utils.data.sft.packing import ExampleBatch
from model_utils.models.custom.contract import hook, loss_of
from model_utils.models.offload import HostActivations
from model_utils.models.sequence_parallel import shard_inputs
from model_utils.patches.deepspeed_zero import device_skip_flag, settle_device_skip
from model_utils.train.run import Run


# ----------------------------------------------------------------------------------------------------------------------
# Steps
# ----------------------------------------------------------------------------------------------------------------------
def model_inputs(run: Run, blocks) -> dict:
    """The model's keyword arguments for packed blocks of seq_len + 1 tokens (a host array): inputs are each block's
    first T tokens, targets its last T (already shifted). With --document_mask, positions restart after each EOS,
    from which transformers masks attention to each document; FlashAttention-4 takes the documents' boundaries
    instead. Both come from the host's copy of the tokens: nothing waits on the GPU for them. With
    --sequence_parallel, this rank's slice of each sequence (positions always given: Ulysses gathers them)."""
    device = run.dist.device
    if isinstance(blocks, UserBatch):  # a dataset of your own: its collated keys, tensors on the device
        return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v
                for k, v in blocks.inputs.items()}
    if isinstance(blocks, ExampleBatch):
        batch = example_inputs(run, blocks)
    else:
        batch = block_inputs(run, blocks, device)
    if run.dist.sequence_parallel > 1:
        return shard_inputs(batch, run.dist.sequence_rank, run.dist.sequence_parallel)
    return batch


def block_inputs(run: Run, blocks, device) -> dict:
    """`model_inputs` of packed blocks of text (not fine-tuning examples), whole sequences."""
    on_device = to_device(blocks, device)
    inputs, targets = on_device[:, :-1].contiguous(), on_device[:, 1:].contiguous()
    batch = {"input_ids": inputs, "labels": targets, "shift_labels": targets}
    if run.document_eos is None and run.dist.sequence_parallel > 1:
        positions = np.broadcast_to(np.arange(run.batch.seq_len), inputs.shape).copy()
        batch["position_ids"] = to_device(positions, device)
    if run.document_eos is not None:
        positions = document_positions(blocks[:, :-1], run.document_eos)
        batch["position_ids"] = to_device(positions, device)
        if run.document_boundaries:
            boundaries = to_device(document_boundaries(positions), device)
            torch._dynamo.maybe_mark_dynamic(boundaries, 0)  # their count varies: one compiled graph for all
            batch.update(cu_seq_lens_q=boundaries, cu_seq_lens_k=boundaries, max_length_q=run.batch.seq_len,
                         max_length_k=run.batch.seq_len)
    return batch


def example_inputs(run: Run, batch) -> dict:
    """The model's keyword arguments for a batch of packed examples (data.sft.packing.ExampleBatch): its targets (-100
    outside the answers) and positions restarting at every example; FlashAttention-4 takes the examples' boundaries."""
    arrays = batch.model_arrays(run.document_boundaries)
    inputs = {k: to_device(v, run.dist.device) if hasattr(v, "shape") else v for k, v in arrays.items()}
    if "cu_seq_lens_q" in inputs:
        torch._dynamo.maybe_mark_dynamic(inputs["cu_seq_lens_q"], 0)  # their count varies: one compiled graph
    return inputs


def attention_area(run: Run, blocks) -> int:
    """The query-key pairs the blocks' attention covers, for FLOPs and MFU: T² per block, or each document's length
    squared with --document_mask, each example's with fine-tuning data (model FLOPs: what the kernel computes, or
    skips, does not change them)."""
    if isinstance(blocks, ExampleBatch):
        return document_area(blocks.position_ids)
    if isinstance(blocks, UserBatch):  # a model of your own counts its FLOPs by its flops hook
        return 0
    if run.document_eos is None:
        return len(blocks) * run.batch.seq_len ** 2
    return document_area(document_positions(blocks[:, :-1], run.document_eos))


def compute_loss(engine, batch: dict, offload: HostActivations | None = None, custom=None):
    """Mean next-token loss over the batch (`model_inputs`); with `offload` (--offload_activations), what the forward
    keeps for the backward pass in its host buffers. A model of your own (`custom`: planning.custom.CustomPlan) gets
    the batch as it is and returns its loss by its contract (models.custom.contract.loss_of)."""
    if custom is not None:
        return loss_of(engine(**batch), custom.spec)[0]
    with offload.saving() if offload else contextlib.nullcontext():
        output = engine(**batch, use_cache=False)
    return output.loss if hasattr(output, "loss") else loss_of(output, "--model")[0]


@dataclass
class StepResult:
    """One optimizer step on this rank, its tensors still on the device (nothing here waits for the GPU)."""

    loss_sum: object  # the micro-batches' losses summed (float64; a non-finite one counts 0)
    nonfinite: object  # whether any micro-batch's loss was inf/NaN (bool)
    attention_area: int  # query-key pairs the step's attention covered (FLOPs)
    blocks: list  # the block indices this rank read, in order (--trace_data)
    pairs: object = None  # preference tuning: the sums of what its steps log (models.preference.PairTerms)
    vision_flops: float = 0.0  # a vision-language model's tower and projector on the step's images (MFU)


@dataclass
class StepFlags:
    """What every rank decided together after a step (`agree_after_step`)."""

    stop: bool  # a stop signal reached some rank
    nonfinite_loss: bool  # some rank's loss was not finite
    save_due: bool  # rank 0's clock says a save is due (--checkpoint_minutes)


def no_phase(name: str):
    return NO_PHASE


NO_PHASE = contextlib.nullcontext()


def train_step(run: Run, phase=no_phase) -> StepResult:
    """One optimizer step: grad_accum micro-batches of forward and backward, DeepSpeed applying the update at the
    accumulation boundary, the data position advanced. `phase(name)` wraps the forward, backward and step of each
    micro-batch in a context (benchmarks/profiling.py); the training loop and benchmarks/bench.py both call this."""
    dist, engine = run.dist, run.engine
    loss_sum = torch.zeros((), device=dist.device, dtype=torch.float64)
    nonfinite = torch.zeros((), device=dist.device, dtype=torch.bool)
    blocks_read, area, vision_flops = [], 0, 0.0
    split = dist.sequence_parallel > 1
    # Packed examples, or sequences split across ranks: the step's micro-batches read up front, to weigh each loss
    # token of the step alike (a micro-batch's or a slice's own mean would weigh its few tokens as much as many)
    counted = own_loss_tokens(run)  # a model of your own with a loss_tokens hook
    ahead = step_micro_batches(run) if run.examples or split or counted else None
    step_blocks = [blocks for _, blocks in ahead] if ahead else None
    weights = loss_token_weights(run, step_blocks, counted) if (run.examples or counted) and not split else None
    loss_items = split_loss_items(run, step_blocks) if split else None
    for micro in range(run.batch.accumulation):
        with phase("forward"):
            indices, blocks = ahead[micro] if ahead else read_micro_batch(run, run.position)
            if micro == run.batch.accumulation - 1:  # the next step's first micro-batch, read while this one runs
                prefetch_next(run, run.order.advance(run.position))
            blocks_read += indices.tolist()
            if dist.sequence_rank == 0:  # the group's ranks compute one sequence together: its attention once
                area += attention_area(run, blocks)
            inputs = model_inputs(run, blocks)
            if run.vision is not None:
                vision_flops += run.vision.flops.flops(blocks.patches, blocks.image_tokens)
            elif run.custom is not None and "flops" in run.custom.hooks:  # your model's own count (MFU)
                vision_flops += float(hook(run.model, "flops")(inputs))
            if loss_items is not None:
                inputs["num_items_in_batch"] = loss_items
            loss = compute_loss(engine, inputs, run.offload, run.custom)
            if weights is not None:
                loss = loss * weights[micro]
        loss_sum, nonfinite = backward_and_step(run, loss, phase, loss_sum, nonfinite)
    run.step += 1
    run.tokens_seen += run.batch.tokens_per_step
    return StepResult(loss_sum, nonfinite, area, blocks_read, vision_flops=vision_flops)


def prefetch_next(run: Run, position) -> None:
    """Where the data read their micro-batches' inputs in the background (images: data.vision.packing), start the
    micro-batch at `position`, so that it is ready when the step reaches it."""
    prefetch = getattr(run.data.train, "prefetch", None)
    if prefetch is not None:
        prefetch(run.order.rank_indices(position, run.dist.data_rank))


def backward_and_step(run: Run, loss, phase, loss_sum, nonfinite) -> tuple:
    """A micro-batch's backward and DeepSpeed's step (the update at the accumulation boundary), the data position
    advanced; returns the step's loss sum and non-finite flag with this micro-batch's loss (a non-finite one counts
    0 in the sum)."""
    with phase("backward"):
        run.engine.backward(loss)
    with phase("step"):
        run.engine.step()
        run.position = run.order.advance(run.position)
    return (loss_sum + torch.nan_to_num(loss.detach().double(), nan=0.0, posinf=0.0, neginf=0.0),
            nonfinite | ~torch.isfinite(loss.detach()))


def read_micro_batch(run: Run, position) -> tuple:
    """(block indices, blocks) of this rank's micro-batch at data `position`."""
    indices = run.order.rank_indices(position, run.dist.data_rank)
    return indices, run.data.train.batch(indices)


def step_micro_batches(run: Run) -> list[tuple]:
    """This rank's micro-batches of the coming step, in order (the data position is not advanced)."""
    position, micro_batches = run.position, []
    for _ in range(run.batch.accumulation):
        micro_batches.append(read_micro_batch(run, position))
        position = run.order.advance(position)
    return micro_batches


def own_loss_tokens(run: Run):
    """A model of your own's loss_tokens(batch) hook, where it defines one and reads a dataset of your own."""
    if run.custom is None or "loss_tokens" not in run.custom.hooks:
        return None
    count = hook(run.model, "loss_tokens")
    return lambda blocks: float(count(blocks.inputs)) if isinstance(blocks, UserBatch) else float(blocks.loss_tokens)


def loss_token_weights(run: Run, micro_batches: list, count=None):
    """Per micro-batch, the factor on its mean loss that makes the step's gradient the mean over the loss tokens of
    the whole step, every rank's (Hugging Face's num_items_in_batch): its loss tokens over the step's, times the
    micro-batches per step and the ranks, whose averages DeepSpeed and the loss log take. Without it a micro-batch
    with few answer tokens would weigh as much as one with many. One all-reduce of the step's count."""
    count = count or (lambda blocks: float(blocks.loss_tokens))
    counts = torch.tensor([count(blocks) for blocks in micro_batches], dtype=torch.float64)
    counts = counts.to(run.dist.device)
    total = run.dist.all_reduce(counts.sum())
    return (counts * (len(micro_batches) * run.batch.world) / total).float()


def split_loss_items(run: Run, micro_batches: list) -> float:
    """With --sequence_parallel: the divisor of each slice's summed loss (transformers' num_items_in_batch) that
    makes the step's gradient the mean over every loss token of the step. DeepSpeed sums the gradients of a group's
    ranks (their slices are one sequence) and averages over the groups and micro-batches; so each slice's loss is its
    sum over the step's loss tokens, times the groups and micro-batches. One all-reduce of the step's count (each
    group's ranks count the same blocks)."""
    count = sum(float(blocks.loss_tokens) if isinstance(blocks, ExampleBatch) else float(blocks[:, 1:].size)
                for blocks in micro_batches)
    total = run.dist.all_reduce(torch.tensor(count, dtype=torch.float64, device=run.dist.device)).item()
    total /= run.dist.sequence_parallel
    return max(total, 1.0) / (len(micro_batches) * run.batch.world)


def agree_after_step(run: Run, result: StepResult, stop_received: bool = False, save_due: bool = False) -> StepFlags:
    """The one collective after every step: a stop signal on any rank, a non-finite loss, an update the GPU skipped
    (--overflow_check device: booked here as DeepSpeed books one it skips), a save due by rank 0's clock, and the
    state of a checkpoint written in the background (committed once every rank has written it)."""
    dist = run.dist
    writes = run.saves.local_state() if run.saves else 0.0
    flags = torch.stack([torch.tensor(float(stop_received), device=dist.device), result.nonfinite.float(),
                         device_skip_flag(run.engine, dist.device), torch.tensor(float(save_due), device=dist.device),
                         torch.tensor(writes, device=dist.device)])
    dist.all_reduce(flags, torch.distributed.ReduceOp.MAX)
    stop, nonfinite_loss, skipped_on_device, save_due = (flags[:4] > 0).tolist()
    if run.saves:
        run.saves.agreed(flags[4].item())
    if skipped_on_device:
        settle_device_skip(run.engine)
    return StepFlags(stop, nonfinite_loss, save_due)


def to_device(array, device):
    tensor = torch.from_numpy(array)
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor
