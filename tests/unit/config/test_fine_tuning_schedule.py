"""--num_epochs as optimizer steps, checked against the data order itself (BlockOrder), on resume too; the
fine-tuning defaults."""

from __future__ import annotations

import numpy as np
import pytest

from model_utils.config.fine_tuning import (FULL_FINE_TUNING_LR, LORA_LR, describe_epochs, epochs_problems,
                                            fine_tuning_defaults, steps_for_epochs, steps_to_finish)
from model_utils.data.blocks import BlockOrder, DataPosition


def run_steps(order: BlockOrder, accumulation: int, steps: int, position: DataPosition | None = None) -> DataPosition:
    position = position or DataPosition()
    for _ in range(steps * accumulation):
        position = order.advance(position)
    return position


@pytest.mark.parametrize("blocks, world, micro, accumulation, epochs", [
    (100, 2, 4, 1, 2), (100, 2, 4, 3, 2), (64, 1, 8, 2, 1), (1000, 4, 2, 5, 3), (100, 2, 4, 1, 0.5),
])
def test_the_steps_cover_exactly_the_epochs_asked_for(blocks, world, micro, accumulation, epochs):
    order = BlockOrder(np.arange(blocks), seed=1, world_size=world, micro_batch=micro)
    steps = steps_for_epochs(epochs, blocks, world, micro, accumulation)
    end = run_steps(order, accumulation, steps)
    covered = end.epoch + end.blocks_consumed / (order.global_batches_per_epoch * order.per_global_batch)
    assert covered >= epochs  # the last step completes the epochs
    before = run_steps(order, accumulation, steps - 1)
    assert before.epoch + before.blocks_consumed / (order.global_batches_per_epoch * order.per_global_batch) < epochs


def test_the_description_names_epochs_steps_and_what_an_epoch_leaves_out():
    line = describe_epochs(2, steps_for_epochs(2, 100, 2, 4, 1), 100, 2, 4, 1)
    assert line.startswith("2 epochs = 24 steps (12 micro-batches of 8 blocks per epoch, 1 per step")
    assert "4 blocks left out of each epoch" in line
    assert "left out" not in describe_epochs(1, 8, 64, 1, 8, 1)


@pytest.mark.parametrize("resume_at", [1, 6, 7, 11, 12])
def test_a_resume_with_the_same_batch_keeps_the_step_count(resume_at):
    blocks, world, micro, accumulation, epochs = 100, 2, 4, 2, 2
    order = BlockOrder(np.arange(blocks), 1, world, micro)
    total = steps_for_epochs(epochs, blocks, world, micro, accumulation)
    at = run_steps(order, accumulation, resume_at)
    assert steps_to_finish(epochs, blocks, world, micro, accumulation, resume_at, at.epoch,
                           at.blocks_consumed) == total


@pytest.mark.parametrize("epochs, ends_at", [(2, (2, 0)), (1.5, (1, 48))])
def test_a_resume_on_another_world_size_still_ends_where_the_epochs_do(epochs, ends_at):
    blocks, micro, accumulation = 96, 4, 1
    first = BlockOrder(np.arange(blocks), 1, 2, micro)
    at = run_steps(first, accumulation, 5)  # 40 of 96 blocks of epoch 0, on 2 ranks
    second = BlockOrder(np.arange(blocks), 1, 4, micro)  # resumed on 4 ranks: 6 micro-batches of 16 per epoch
    end_step = steps_to_finish(epochs, blocks, 4, micro, accumulation, 5, at.epoch, at.blocks_consumed)
    end = run_steps(second, accumulation, end_step - 5, at)
    assert (end.epoch, end.blocks_consumed) == ends_at
    before = run_steps(second, accumulation, end_step - 6, at)
    assert (before.epoch, before.blocks_consumed) < ends_at


def test_epochs_problems_name_the_conflict_and_data_too_small():
    assert epochs_problems(None, 100, 10, 2, 4) == []
    assert epochs_problems(2, None, 100, 2, 4) == []
    settings = [p.message for p in epochs_problems(0, 50, 4, 2, 4)]
    assert any("must be positive" in m for m in settings)
    assert any("--max_steps 50 both set the length" in m for m in settings)
    assert any("4 training blocks, fewer than one micro-batch" in m for m in settings)


def test_fine_tuning_defaults_for_full_and_lora_runs():
    full, lora = fine_tuning_defaults(1000, lora=False), fine_tuning_defaults(1000, lora=True)
    assert (full.learning_rate, lora.learning_rate) == (FULL_FINE_TUNING_LR, LORA_LR) == (2e-5, 2e-4)
    assert full.warmup_steps == lora.warmup_steps == 30 and full.weight_decay == 0.0
    assert fine_tuning_defaults(10, lora=False).warmup_steps == 2  # DeepSpeed's schedulers take at least 2
    assert "TRL SFTConfig" in full.describe() and "QLoRA" in lora.describe()
