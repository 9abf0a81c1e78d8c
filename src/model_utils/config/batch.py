"""The batch: the micro-batch, gradient accumulation and global batch that ds_config.json, the flags and the world size
ask for (`BatchRequest`), settled once the micro-batch is chosen (`settle_batch` -> `Batch`, written back into the
DeepSpeed config by `with_batch`). The global batch is stated once, in tokens or in DeepSpeed's train_batch_size; the
rest follows from it.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from model_utils.config.deepspeed import AUTO, leftover_autos
from model_utils.config.settings import BatchConfig
from model_utils.core.problems import Problem

# The settings a batch problem names: the plan is not sized while one of them is wrong.
BATCH_SETTINGS = ("train_", "gradient_acc", "--global_batch_tokens", "--micro_batch_size", "--gradient_accumulation")


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


BATCH_KEYS = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size")


@dataclass(frozen=True)
class BatchRequest:
    """The batch as the flags and the config state it, before a micro-batch is chosen: micro x accumulation x world =
    blocks per optimizer step.

    The global batch is stated once: --global_batch_tokens, else a concrete train_batch_size; the accumulation is then
    derived (`accumulation_at`), so a change of node count keeps the optimisation the same. The micro-batch is the
    flag's, else the config's, else (None) chosen automatically among those that `divides`. Without a global batch
    the accumulation is the flag's, else the config's, else 1."""

    world: int
    blocks: int | None  # blocks per optimizer step where stated
    micro: int | None  # the micro-batch given; None: automatic
    accumulation: int | None  # the accumulation given (flag or config); derived where `blocks` is stated
    accumulation_flag: int | None  # --gradient_accumulation_steps, checked against a derived accumulation
    config_accumulation: object  # the config's gradient_accumulation_steps as written
    global_batch_tokens: int | None  # --global_batch_tokens, for messages
    seq_len: int

    @classmethod
    def of(cls, raw: dict, batch: BatchConfig, world: int, seq_len: int | None
           ) -> tuple[BatchRequest | None, list[str], list[Problem]]:
        """(the request, notes, problems); None where the batch cannot be stated (a problem says why)."""
        notes: list[str] = []
        blocks = None
        given = raw.get("train_batch_size", AUTO)
        if batch.global_batch_tokens is not None and seq_len:
            if batch.global_batch_tokens % seq_len:
                low = max(seq_len, batch.global_batch_tokens // seq_len * seq_len)
                return None, notes, [Problem("--global_batch_tokens", batch.global_batch_tokens,
                                             f"is not a whole number of blocks of {seq_len} tokens (--seq_len)",
                                             f"use a multiple of {seq_len}, e.g. {low} or {low + seq_len}")]
            blocks = batch.global_batch_tokens // seq_len
            if given not in (AUTO, blocks):
                notes.append(f"--global_batch_tokens {batch.global_batch_tokens:,} ({blocks} blocks of {seq_len}) "
                             f"overrides train_batch_size={given}")
        elif given != AUTO:
            if not _positive_int(given):
                return None, notes, [Problem("train_batch_size", given,
                                             "must be a positive integer (blocks per optimizer step)",
                                             'set "train_batch_size": "auto" and state the batch with '
                                             '--global_batch_tokens')]
            blocks = given
        micro = batch.micro_batch_size if batch.micro_batch_size is not None else raw.get(
            "train_micro_batch_size_per_gpu", AUTO)
        if micro != AUTO and not _positive_int(micro):
            return None, notes, [Problem("train_micro_batch_size_per_gpu", micro, "must be a positive integer",
                                         'set "train_micro_batch_size_per_gpu" to 1 or more, or "auto" (sized by '
                                         'the GPU memory)')]
        config_micro = raw.get("train_micro_batch_size_per_gpu", AUTO)
        if batch.micro_batch_size not in (None, AUTO) and config_micro not in (AUTO, batch.micro_batch_size):
            notes.append(f"--micro_batch_size {batch.micro_batch_size} overrides "
                         f"train_micro_batch_size_per_gpu={config_micro} from the DeepSpeed config")
        config_accum = raw.get("gradient_accumulation_steps", AUTO)
        accumulation = None
        if blocks is None:
            accumulation = batch.gradient_accumulation_steps or (1 if config_accum == AUTO else config_accum)
            if not _positive_int(accumulation):
                return None, notes, [Problem("gradient_accumulation_steps", accumulation, "must be a positive integer",
                                             'set "gradient_accumulation_steps" to 1 or more, or "auto"')]
            if batch.gradient_accumulation_steps and config_accum not in (AUTO, accumulation):
                notes.append(f"--gradient_accumulation_steps {accumulation} overrides "
                             f"gradient_accumulation_steps={config_accum} from the DeepSpeed config")
        return cls(world, blocks, None if micro == AUTO else micro, accumulation, batch.gradient_accumulation_steps,
                   config_accum, batch.global_batch_tokens, seq_len or 0), notes, []

    def divides(self, micro: int) -> bool:
        """Whether `micro` blocks per rank make up the global batch in whole micro-batches."""
        return self.blocks is None or self.blocks % (micro * self.world) == 0

    def accumulation_at(self, micro: int) -> int | None:
        """The accumulation with micro-batch `micro`: the one rule. None where the global batch does not divide."""
        if self.blocks is None:
            return self.accumulation
        return self.blocks // (micro * self.world) if self.divides(micro) else None

    @property
    def stated(self) -> str:
        return (f"--global_batch_tokens {self.global_batch_tokens:,}" if self.global_batch_tokens is not None
                else f"train_batch_size {self.blocks}")


def settle_batch(request: BatchRequest, micro: int, seq_len: int) -> tuple[Batch | None, list[str], list[Problem]]:
    """The batch at micro-batch `micro` (the given one or the automatic choice): (Batch, notes, problems)."""
    notes: list[str] = []
    accumulation = request.accumulation_at(micro)
    world, blocks = request.world, request.blocks
    if accumulation is None:
        if request.global_batch_tokens is not None:
            return None, notes, [Problem("--global_batch_tokens", request.global_batch_tokens,
                                         f"{blocks} blocks per step is not a multiple of micro-batch {micro} x world "
                                         f"size {world}", f"use a multiple of {micro * world * request.seq_len:,} "
                                         "tokens, or another micro-batch")]
        return None, notes, [Problem("train_batch_size", blocks,
                                     f"is not a multiple of micro-batch {micro} x world size {world}",
                                     f'set "train_batch_size": "auto" (or a multiple of {micro * world}), or another '
                                     'micro-batch')]
    if blocks is not None:
        flag, config_accum = request.accumulation_flag, request.config_accumulation
        if flag is not None and flag != accumulation:
            return None, notes, [Problem("--gradient_accumulation_steps", flag,
                                         f"contradicts {request.stated}: {blocks} blocks / (micro {micro} x world "
                                         f"{world}) = {accumulation}",
                                         "drop --gradient_accumulation_steps: it is derived from the global batch")]
        if config_accum not in (AUTO, accumulation):
            if request.global_batch_tokens is None:
                return None, notes, [Problem("train_batch_size", blocks,
                                             f"must equal micro ({micro}) x grad_acc ({config_accum}) x world size "
                                             f"({world}) = {micro * config_accum * world}",
                                             'set "gradient_accumulation_steps": "auto" to derive it from '
                                             'train_batch_size, or "train_batch_size": "auto"')]
            notes.append(f"gradient_accumulation_steps={config_accum} replaced by {accumulation}, derived from "
                         f"{request.stated}")
    return Batch(micro, accumulation, world, seq_len), notes, []


def with_batch(ds: dict, batch: Batch, notes: list[str], problems: list[Problem]
               ) -> tuple[dict, list[str], list[Problem]]:
    """`ds` with the settled batch written (DeepSpeed's three keys) and no "auto" left: the config the engine takes."""
    ds = copy.deepcopy(ds)
    ds.update(train_micro_batch_size_per_gpu=batch.micro, gradient_accumulation_steps=batch.accumulation,
              train_batch_size=batch.blocks_per_step)
    for path, value in leftover_autos(ds):
        problems.append(Problem(path, value, "has no automatic value in this project",
                                "replace \"auto\" by a concrete value"))
    return ds, notes, problems


@dataclass(frozen=True)
class Batch:
    """The batch arithmetic, in one place for the trainer, the preflight and the benchmark: DeepSpeed's micro-batch
    and gradient accumulation (the resolved config, flags applied), the world size and the block length."""

    micro: int  # blocks per rank per forward/backward (train_micro_batch_size_per_gpu)
    accumulation: int  # micro-batches per optimizer step (gradient_accumulation_steps)
    world: int  # data-parallel ranks
    seq_len: int  # tokens per block

    @classmethod
    def of(cls, ds: dict, world: int, seq_len: int) -> Batch:
        return cls(ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"], world, seq_len)

    @property
    def blocks_per_step(self) -> int:
        return self.micro * self.accumulation * self.world  # DeepSpeed's train_batch_size

    @property
    def tokens_per_step(self) -> int:
        return self.blocks_per_step * self.seq_len

    @property
    def tokens_per_rank_step(self) -> int:
        return self.micro * self.accumulation * self.seq_len

    def describe(self) -> str:
        return (f"micro {self.micro} x grad_acc {self.accumulation} x world {self.world} = {self.blocks_per_step} "
                f"blocks of {self.seq_len} tokens = {self.tokens_per_step:,} tokens/step")

    def plan(self, steps: int, train_tokens: int | None = None, streamed: bool = False) -> str:
        total = self.tokens_per_step * steps
        if streamed:  # a stream's size is not known before it is read
            return f"{steps} steps = {total:,} tokens (epochs unknown: the data streams)"
        return f"{steps} steps = {total:,} tokens" + (f" ({total / train_tokens:.2f} epochs)" if train_tokens else "")
