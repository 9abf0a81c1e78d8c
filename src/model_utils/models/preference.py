"""Preference tuning's model side: each sequence's answer log-probability without the batch's logits, and the
objectives on them.

Log-probabilities: the model runs as usual, except that its LM head sees only the first position during the forward;
its full input, the final hidden states, is kept, and the log-softmax of the answer tokens alone is taken through the
LM head in chunks of CHUNK_TOKENS tokens, each chunk's logits recomputed in the backward pass
(torch.utils.checkpoint): one chunk of fp32 logits exists at a time, never the batch's. The LM head is called as a
module, so ZeRO-3 gathers its weight, in the forward and again in the recomputation. The per-token log-probabilities
join the model's output (`log_probs`) inside its forward, where DeepSpeed's engine finds them among the outputs it
starts the backward pass from. Each sequence's sum (and its count of answer tokens) follows from where its positions
restart.

Objectives, as TRL 1.16 defines them (rewards, logps: what TRL logs):

| objective | score of an answer | loss per pair | rewards |
| --- | --- | --- | --- |
| dpo | sum of log-probs | -log sigmoid(beta (d_chosen - d_rejected)), d = policy - reference | beta d |
| ipo | sum of log-probs | (d_chosen / n_chosen - d_rejected / n_rejected - 1 / (2 beta))^2 | beta d |
| simpo | mean log-prob per token | -log sigmoid(beta (s_chosen - s_rejected) - gamma) | beta s |
| orpo | mean log-prob per token | NLL of the chosen tokens - beta log sigmoid(log odds(chosen) - log odds(rejected)) | beta s |

ORPO's NLL is the mean over all chosen answer tokens of the step (TRL: over its batch), its odds-ratio term a mean
over pairs; `PairTerms` keeps the two apart so the step weighs each by its own count.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from model_utils.config.preference import PreferenceSettings
from model_utils.data.sft.formats import IGNORE_INDEX

CHUNK_TOKENS = 1024  # fp32 logits of one chunk: 1024 x 151,936 x 4 bytes = 0.6 GiB for Qwen3


# ----------------------------------------------------------------------------------------------------------------------
# Log-probabilities of the answer tokens
# ----------------------------------------------------------------------------------------------------------------------
def _chunk_log_probs(head, hidden, targets):
    logits = head(hidden).float()
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def target_log_probs(head, hidden, targets, chunk_tokens: int = CHUNK_TOKENS):
    """Log-probability of each target (B x T, fp32; 0 where the target is IGNORE_INDEX) given `hidden` (B x T x H,
    the final hidden states), through `head` chunk by chunk; with gradients on, each chunk is recomputed in the
    backward pass instead of keeping its logits."""
    mask = targets != IGNORE_INDEX
    picked, wanted = hidden[mask], targets[mask]
    pieces = []
    for start in range(0, picked.shape[0], chunk_tokens):
        args = (head, picked[start:start + chunk_tokens], wanted[start:start + chunk_tokens])
        pieces.append(checkpoint(_chunk_log_probs, *args, use_reentrant=False) if torch.is_grad_enabled()
                      else _chunk_log_probs(*args))
    flat = torch.cat(pieces) if pieces else picked.new_zeros(0, dtype=torch.float32)
    return torch.zeros(mask.shape, dtype=torch.float32, device=hidden.device).masked_scatter(mask, flat)


@contextmanager
def answer_log_probs(model, targets, chunk_tokens: int = CHUNK_TOKENS):
    """While active, a forward of `model` (a causal LM, or peft's wrapper of one) computes its LM head at the first
    position only and returns `log_probs` (target_log_probs of `targets`) among its outputs."""
    head = model.get_output_embeddings()
    state = {"hidden": None, "scoring": False}

    def keep_first_position(module, args):
        if state["scoring"]:  # the chunks' own calls
            return None
        state["hidden"] = args[0]
        return (args[0][..., :1, :], *args[1:])

    def add_log_probs(module, args, kwargs, output):
        state["scoring"] = True
        try:
            output["log_probs"] = target_log_probs(head, state.pop("hidden"), targets, chunk_tokens)
        finally:
            state["scoring"], state["hidden"] = False, None
        return output

    handles = [head.register_forward_pre_hook(keep_first_position),
               # first among the model's hooks: ZeRO-3's own see the log-probabilities as the forward's output
               model.register_forward_hook(add_log_probs, prepend=True, with_kwargs=True)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@dataclass
class PairLogps:
    """Per pair (P): the summed log-probability of the chosen and of the rejected answer, and their answer tokens."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    chosen_tokens: torch.Tensor
    rejected_tokens: torch.Tensor

    def detached(self) -> PairLogps:
        return PairLogps(*(t.detach() for t in (self.chosen, self.rejected, self.chosen_tokens, self.rejected_tokens)))


def pair_log_probs(per_token, targets, segment_ids, segments: int, pairs) -> PairLogps:
    """Sum each sequence's log-probabilities (`segment_ids`: each position's sequence among the batch's `segments`,
    flattened) and pick each pair's two (`pairs`: P x 3, its number, chosen and rejected sequence)."""
    flat = per_token.reshape(-1)
    sums = flat.new_zeros(segments).index_add(0, segment_ids, flat)
    counts = flat.new_zeros(segments).index_add(0, segment_ids, (targets.reshape(-1) != IGNORE_INDEX).float())
    chosen, rejected = pairs[:, 1], pairs[:, 2]
    return PairLogps(sums[chosen], sums[rejected], counts[chosen], counts[rejected])


def score_pairs(forward, model, inputs: dict, targets, segment_ids, segments: int, pairs,
                chunk_tokens: int = CHUNK_TOKENS) -> PairLogps:
    """Run `forward(**inputs)` (the DeepSpeed engine, or the model) with `model`'s answer log-probabilities kept,
    and sum them per pair."""
    with answer_log_probs(model, targets, chunk_tokens):
        per_token = forward(**inputs, use_cache=False)["log_probs"]
    return pair_log_probs(per_token, targets, segment_ids, segments, pairs)


# ----------------------------------------------------------------------------------------------------------------------
# Objectives
# ----------------------------------------------------------------------------------------------------------------------
@dataclass
class PairTerms:
    """Per pair (P): its loss term (mean over pairs), its token-summed term (mean over the step's chosen answer tokens:
    ORPO's NLL; zero elsewhere), and what is logged."""

    loss: torch.Tensor
    token_loss: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor
    chosen_logps: torch.Tensor
    rejected_logps: torch.Tensor

    def metric_sums(self) -> torch.Tensor:
        """The sums of what is logged (METRICS' order, the pair count first), float64."""
        c, r = self.chosen_rewards.detach().double(), self.rejected_rewards.detach().double()
        return torch.stack([torch.tensor(float(len(c)), dtype=torch.float64, device=c.device), c.sum(), r.sum(),
                            (c > r).double().sum(), (c - r).sum(), self.chosen_logps.detach().double().sum(),
                            self.rejected_logps.detach().double().sum()])


# TRL's names of what a step logs, in PairTerms.metric_sums' order after the pair count.
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")


def log1mexp(x):
    """log(1 - exp(x)) for x < 0, without cancellation on either side of -ln 2."""
    return torch.where(x < -math.log(2), torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def pair_terms(settings: PreferenceSettings, policy: PairLogps, reference: PairLogps | None) -> PairTerms:
    """The objective's terms for each pair (module docstring's table)."""
    beta, zero = settings.beta, torch.zeros_like(policy.chosen)
    if settings.length_normalized:
        chosen = policy.chosen / policy.chosen_tokens.clamp(min=1)
        rejected = policy.rejected / policy.rejected_tokens.clamp(min=1)
        if settings.objective == "simpo":
            loss = -F.logsigmoid(beta * (chosen - rejected) - settings.simpo_gamma)
            return PairTerms(loss, zero, beta * chosen, beta * rejected, chosen, rejected)
        log_odds = (chosen - rejected) - (log1mexp(chosen) - log1mexp(rejected))
        return PairTerms(-beta * F.logsigmoid(log_odds), -policy.chosen, beta * chosen, beta * rejected, chosen,
                         rejected)
    chosen_ratio, rejected_ratio = policy.chosen - reference.chosen, policy.rejected - reference.rejected
    if settings.objective == "ipo":
        gap = (chosen_ratio / policy.chosen_tokens.clamp(min=1) - rejected_ratio / policy.rejected_tokens.clamp(min=1))
        loss = (gap - 1 / (2 * beta)) ** 2
    else:
        loss = -F.logsigmoid(beta * (chosen_ratio - rejected_ratio))
    return PairTerms(loss, zero, beta * chosen_ratio, beta * rejected_ratio, policy.chosen, policy.rejected)
