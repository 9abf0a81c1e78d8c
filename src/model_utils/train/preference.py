"""Preference tuning's step and evaluation: where a preference run differs from fine-tuning (the loop calls
`preference_step` instead of train_step, and `preference_evaluation` instead of evaluate).

A micro-batch is blocks of pairs (data.preference.packing): one forward scores every chosen and rejected answer
(models.preference.score_pairs); the reference's scores come from the step-0 model's stored log-probabilities
(full fine-tuning: train.reference), from the same model with its adapters off under no_grad (LoRA), or are not
needed (SimPO, ORPO). Each pair weighs the same in a step whatever micro-batch and rank it is on: a micro-batch's
summed loss is multiplied by the micro-batches and ranks per step over the step's pairs on all ranks (as fine-tuning
weighs its tokens, train.step.loss_token_weights); ORPO's NLL weighs each chosen answer token alike.
"""

from __future__ import annotations

import contextlib
import math

import numpy as np
import torch

from model_utils.data.preference.packing import PairBatch
from model_utils.models.lora import adapters_disabled
from model_utils.models.preference import METRICS, PairLogps, pair_terms, score_pairs
from model_utils.patches.deepspeed_offload import settle
from model_utils.train.run import Run
from model_utils.train.step import (StepResult, attention_area, backward_and_step, example_inputs, no_phase,
                                    step_micro_batches, to_device)


# ----------------------------------------------------------------------------------------------------------------------
# Scoring a batch of pairs
# ----------------------------------------------------------------------------------------------------------------------
def pair_inputs(run: Run, batch: PairBatch) -> dict:
    """The model's keyword arguments for a batch of pairs: the packed examples' (train.step.example_inputs) without
    labels, which the model would take its own loss over."""
    inputs = example_inputs(run, batch)
    inputs.pop("labels")
    inputs.pop("shift_labels")
    return inputs


def scores(run: Run, batch: PairBatch, inputs: dict) -> PairLogps:
    """The summed log-probabilities of each pair's answers under the model as it runs now."""
    device = run.dist.device
    return score_pairs(run.engine, run.engine.module, inputs, to_device(batch.targets, device),
                       to_device(batch.segment_ids(), device), batch.segments, to_device(batch.pairs, device))


def reference_scores(run: Run, batch: PairBatch, inputs: dict, split: str) -> PairLogps | None:
    """The reference's scores of the batch's pairs (None for a reference-free objective): stored for full
    fine-tuning, the frozen base with the adapters off for LoRA."""
    if not run.preference.needs_reference:
        return None
    if run.reference is not None:
        rows = torch.from_numpy(run.reference.rows(split, batch.pairs[:, 0])).float().to(run.dist.device)
        return PairLogps(rows[:, 0], rows[:, 1], None, None)
    with torch.no_grad(), adapters_disabled(run.engine.module):
        return scores(run, batch, inputs).detached()


def validation_split(run: Run) -> str:
    """Which split file of the pairs the validation blocks are in (held out of the training split, or its own)."""
    return "train" if run.data.val is run.data.train else "validation"


# ----------------------------------------------------------------------------------------------------------------------
# The step
# ----------------------------------------------------------------------------------------------------------------------
def pair_weights(run: Run, micro_batches: list) -> tuple[torch.Tensor, torch.Tensor]:
    """Per micro-batch, the factor on its summed pair losses and on its summed token losses (ORPO's NLL) that makes
    the step's loss the mean over the pairs (and over the chosen answer tokens) of all ranks, DeepSpeed averaging
    over the micro-batches and ranks. One all-reduce of the step's counts."""
    counts = torch.tensor([[batch.num_pairs, batch.answer_tokens()[batch.pairs[:, 1]].sum()]
                           for batch in micro_batches], dtype=torch.float64).to(run.dist.device)
    total = run.dist.all_reduce(counts.sum(0))
    scale = len(micro_batches) * run.batch.world
    return scale / total[0].clamp(min=1), scale / total[1].clamp(min=1)


def preference_step(run: Run, phase=no_phase) -> StepResult:
    """One optimizer step on pairs: train.step.train_step's structure (forward, backward, DeepSpeed's step per
    micro-batch), the objective's loss in place of the model's, the logged sums of its pairs kept."""
    dist, settings = run.dist, run.preference
    loss_sum = torch.zeros((), device=dist.device, dtype=torch.float64)
    nonfinite = torch.zeros((), device=dist.device, dtype=torch.bool)
    sums = torch.zeros(1 + len(METRICS), device=dist.device, dtype=torch.float64)
    blocks_read, area = [], 0
    ahead = step_micro_batches(run)
    per_pair, per_token = pair_weights(run, [batch for _, batch in ahead])
    for indices, batch in ahead:
        with phase("forward"):
            blocks_read += indices.tolist()
            area += attention_area(run, batch)
            inputs = pair_inputs(run, batch)
            reference = reference_scores(run, batch, inputs, "train")
            with run.offload.saving() if run.offload else contextlib.nullcontext():  # --offload_activations
                policy = scores(run, batch, inputs)
            terms = pair_terms(settings, policy, reference)
            loss = (terms.loss.sum() * per_pair + terms.token_loss.sum() * per_token).float()
        loss_sum, nonfinite = backward_and_step(run, loss, phase, loss_sum, nonfinite)
        sums += terms.metric_sums()
    run.step += 1
    run.tokens_seen += run.batch.tokens_per_step
    return StepResult(loss_sum, nonfinite, area, blocks_read, pairs=sums)


def pair_record(sums: list[float], prefix: str = "") -> dict:
    """The logged means of a step's or an evaluation's pair sums (PairTerms.metric_sums, all ranks), TRL's names."""
    count = max(sums[0], 1.0)
    return {prefix + name: value / count for name, value in zip(METRICS, sums[1:])}


# ----------------------------------------------------------------------------------------------------------------------
# Evaluation on the held-out pairs
# ----------------------------------------------------------------------------------------------------------------------
def preference_evaluation(run: Run) -> dict:
    """The objective's loss and what a step logs, over the held-out pairs: each validation block once, up to
    --eval_iters micro-batches per rank (every rank runs as many forwards, ZeRO-3 gathering in each; a slot past the
    last block repeats one whose pairs are not counted)."""
    settle(run.engine)  # the model with every step's update (--delayed_update_from_step)
    ids, dist, m = run.data.val_ids, run.dist, run.batch.micro
    if len(ids) == 0:
        return {}
    engine, settings, split = run.engine, run.preference, validation_split(run)
    rounds = min(run.cfg.logging.eval_iters, math.ceil(len(ids) / (dist.data_world * m)))
    # the loss's pair and token terms and their counts, then the logged sums (PairTerms.metric_sums)
    totals = torch.zeros(4 + 1 + len(METRICS), device=dist.device, dtype=torch.float64)
    engine.eval()
    with torch.no_grad():
        for i in range(rounds):
            start = (i * dist.data_world + dist.data_rank) * m
            batch = run.data.val.batch([ids[(start + j) % len(ids)] for j in range(m)])
            counted = torch.from_numpy((start + batch.pairs[:, 3] < len(ids)).astype(np.float64)).to(dist.device)
            inputs = pair_inputs(run, batch)
            terms = pair_terms(settings, scores(run, batch, inputs), reference_scores(run, batch, inputs, split))
            chosen_tokens = torch.from_numpy(batch.answer_tokens()[batch.pairs[:, 1]]).to(dist.device)
            totals[:4] += torch.stack([(terms.loss.double() * counted).sum(), counted.sum(),
                                       (terms.token_loss.double() * counted).sum(), (chosen_tokens * counted).sum()])
            totals[4:] += counted_sums(terms, counted)
    engine.train()
    loss, pairs, token_loss, tokens, *logged = dist.all_reduce(totals).tolist()
    return {"eval_loss": loss / max(pairs, 1) + token_loss / max(tokens, 1), **pair_record(logged, "eval_")}


def counted_sums(terms, counted: torch.Tensor) -> torch.Tensor:
    """PairTerms.metric_sums over the pairs `counted` marks (1.0) only."""
    keep = counted.bool()
    kept = type(terms)(*(t[keep] for t in (terms.loss, terms.token_loss, terms.chosen_rewards, terms.rejected_rewards,
                                           terms.chosen_logps, terms.rejected_logps)))
    return kept.metric_sums()


def describe_evaluation(result: dict, prefix: str = "eval_") -> str:
    """The evaluation's log line after its label: the loss and the rewards."""
    return (f"loss {result['eval_loss']:.4f}, rewards/accuracies {result[prefix + 'rewards/accuracies']:.3f}, "
            f"rewards/margins {result[prefix + 'rewards/margins']:.4f}, rewards/chosen "
            f"{result[prefix + 'rewards/chosen']:.4f}, rewards/rejected {result[prefix + 'rewards/rejected']:.4f}")

