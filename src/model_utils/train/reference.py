"""The reference of full fine-tuning on pairs: the log-probabilities of every pair under the model at step 0, computed
once, before the first step, by the run's own engine (the same ZeRO partitioning and precision as training: training
holds one model), and stored beside the packed pairs (data.preference.reference), keyed by the model, its precision
and the pairs.

The run is built from the step-0 model and loads a checkpoint only after this (train.build), so even a resume that
finds no stored reference computes it from the step-0 weights, never from trained ones; a checkpoint records the
reference's digest, and a resume whose reference differs from it says so. Costs one forward pass over the pairs (no
backward), every rank scoring its share of the blocks; rank 0 decides whether a stored reference exists and hands it
to the others, so nodes need not share a filesystem.
"""

from __future__ import annotations

import math
import time

import numpy as np
import torch

from model_utils.config.deepspeed import precision
from model_utils.config.presets import is_preset
from model_utils.data.preference.cache import pair_cache_of
from model_utils.data.preference.reference import (StoredReference, merged_reference, model_files_identity,
                                                   read_reference, reference_dir, write_reference)
from model_utils.train.preference import pair_inputs, scores
from model_utils.train.run import Run


def reference_identity(run: Run) -> dict:
    """What the stored log-probabilities depend on beside the pairs: the model at step 0 (a preset's seed makes its
    initial weights) and how it runs."""
    cfg = run.cfg
    return {"model": cfg.model.model, "files": model_files_identity(cfg.model.model),
            "seed": cfg.seed if is_preset(cfg.model.model) else None, "precision": precision(run.ds_config),
            "attention": cfg.model.attn_implementation, "rope_scaling": cfg.model.rope_scaling,
            "attention_dropout": cfg.model.attention_dropout}


def split_files(run: Run) -> dict:
    """The pairs' split files and their packed blocks: the training split's, and the validation split's where it is
    its own (held-out blocks are part of the training split's file)."""
    files = {"train": run.data.train}
    if run.data.val is not run.data.train:
        files["validation"] = run.data.val
    return files


def rank_blocks(num_blocks: int, world: int, rank: int, micro: int) -> list[list[int]]:
    """This rank's micro-batches over a split's blocks, as many for every rank (a slot past the last block repeats
    block 0, whose scores are not kept: -1 marks it)."""
    rounds = math.ceil(num_blocks / (world * micro))
    return [[b if b < num_blocks else -1 for b in range((k * world + rank) * micro, (k * world + rank + 1) * micro)]
            for k in range(rounds)]


def computed_rows(run: Run) -> dict:
    """This rank's share of the reference's rows per split file (pair number, chosen, rejected), scored by the engine
    in eval mode without gradients."""
    dist, engine = run.dist, run.engine
    out = {}
    engine.eval()
    with torch.no_grad():
        for split, packed in split_files(run).items():
            rows = []
            for picks in rank_blocks(packed.num_blocks, dist.data_world, dist.data_rank, run.batch.micro):
                batch = packed.batch([b if b >= 0 else 0 for b in picks])
                kept = np.asarray([picks[row] >= 0 for row in batch.pairs[:, 3]], dtype=bool)
                logps = scores(run, batch, pair_inputs(run, batch))
                values = torch.stack([logps.chosen, logps.rejected], dim=1).double().cpu().numpy()
                rows.append(np.column_stack([batch.pairs[:, 0], values])[kept])
            out[split] = np.concatenate(rows) if rows else np.zeros((0, 3))
    engine.train()
    return out


def prepare_reference(run: Run, plan) -> StoredReference | None:
    """The stored reference of a full fine-tuning run whose objective has one (None otherwise: LoRA's is the base
    with its adapters off, SimPO and ORPO need none), computed now where none is stored. Every rank calls this, on the
    engine at step 0."""
    settings = run.preference
    if settings is None or not settings.needs_reference or run.lora is not None:
        return None
    identity = reference_identity(run)
    directory = reference_dir(pair_cache_of(run.cfg.data, plan.data_source, plan.tokenizer, plan.seq_len), identity)
    stored = read_reference(directory) if run.dist.is_main else None
    stored = run.dist.broadcast_object(stored)
    pairs = {split: packed.num_pairs for split, packed in split_files(run).items()}
    if stored is not None:
        run.log.info(f"reference: the step-0 model's log-probabilities of {sum(pairs.values()):,} pairs read from "
                     f"{directory} (digest {stored.digest})")
        return stored
    t0 = time.perf_counter()
    parts = run.dist.all_gather_object(computed_rows(run))
    stored = merged_reference(parts, pairs)
    if run.dist.is_main:
        write_reference(directory, stored, identity)
    run.log.info(f"reference: the step-0 model's log-probabilities of {sum(pairs.values()):,} pairs computed in "
                 f"{time.perf_counter() - t0:.1f}s (one forward pass over them, by this run's engine) and stored in "
                 f"{directory} (digest {stored.digest})")
    return stored


def reference_manifest(run: Run) -> dict | None:
    """What a checkpoint records of the reference: where it came from and its digest."""
    if run.preference is None:
        return None
    if not run.preference.needs_reference:
        return {"kind": "none"}
    if run.reference is None:
        return {"kind": "adapters off"}
    return {"kind": "stored", "digest": run.reference.digest}


def check_resumed_reference(run: Run, manifest: dict) -> None:
    """A resumed run's stored reference against the checkpoint's: a different one (recomputed on another setup) is
    told, since the rewards are then measured against other numbers."""
    recorded = (manifest or {}).get("reference") or {}
    if run.reference is not None and recorded.get("digest") not in (None, run.reference.digest):
        run.log.warn(f"resume: the reference's log-probabilities (digest {run.reference.digest}) differ from those "
                     f"the checkpoint was trained against ({recorded['digest']}): the step-0 model was scored again "
                     "on another setup (precision, kernels, world size); the run continues with these")
