"""--sequence_parallel 2 on CPU: 2 gloo ranks split each sequence (DeepSpeed's Ulysses all-to-all around the attention)
and train as one rank holding whole sequences does, step for step; a kill -9 resumes bitwise, and one rank resumes their
checkpoint through the universal path. Nothing is mocked.

The two runs sum the same terms in another order (each rank's slice, then the all-to-all and the gradient reduction),
so their fp32 losses agree to float rounding (measured: 1e-7 relative), not bit for bit."""

from __future__ import annotations

import shutil

import pytest
from conftest import FAST_ARGS, Trainer, assert_ok, kill_after_checkpoint_then_resume, run_trainer

from model_utils.checkpoint.protocol import inspect_checkpoint

ARGS = [*FAST_ARGS, "--max_steps", "8", "--checkpoint_freq", "4", "--no-export", "--seed", "5"]
SPLIT = ["--sequence_parallel", "2"]
SFT = ["--dataset", "embedded-chat", "--seq_len", "256", "--max_steps", "6", "--checkpoint_freq", "0"]
RELATIVE = 2e-6  # fp32 rounding of sums taken in another order, over steps whose updates compound it


def _assert_same_training(split, whole, steps):
    got, want = split.losses_by_step(), whole.losses_by_step()
    assert sorted(got) == sorted(want) == list(range(1, steps + 1))
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=RELATIVE), f"step {step}"
    assert len({round(loss, 3) for loss in want.values()}) > 2  # the weights moved: a loss standing still proves little


@pytest.fixture(scope="module")
def split_run(session_cache, tmp_path_factory):
    run = run_trainer(tmp_path_factory.mktemp("split") / "ckpt", [*ARGS, *SPLIT])
    assert_ok(run)
    return run


def test_two_ranks_splitting_each_sequence_train_as_one_rank(split_run, tmp_path):
    """The same blocks (both ranks read the group's, one data-parallel rank), the same updates as one rank."""
    whole = run_trainer(tmp_path / "ckpt", ARGS, nproc=1)
    assert_ok(whole)
    assert "sequence parallelism: each sequence split across 2 GPUs" in split_run.output
    manifest = inspect_checkpoint(split_run.checkpoint_dir / "step-00000008").manifest
    assert manifest["ds_config"]["sequence_parallel_size"] == 2 and manifest["ds_config"]["train_batch_size"] == 2
    records = split_run.train_records()
    assert records[-1]["tokens_seen"] == 8 * 2 * 64  # 2 blocks per step: the group's micro-batch, not two of them
    _assert_same_training(split_run, whole, 8)


def test_fine_tuning_examples_split_across_ranks_train_as_one_rank(session_cache, tmp_path):
    """Packed chat examples: attention stays within each example across the slices (positions and boundaries of the
    whole sequence) and the loss is the mean over the step's answer tokens, whichever slice holds them."""
    started = Trainer(tmp_path / "split", [*FAST_ARGS, *SFT, *SPLIT]), Trainer(tmp_path / "whole", [*FAST_ARGS, *SFT], 1)
    split, whole = (trainer.wait() for trainer in started)  # side by side: most of each run is its start
    assert_ok(split)
    assert_ok(whole)
    assert "attention: within each example" in split.output
    _assert_same_training(split, whole, 6)


def test_a_split_run_killed_after_a_checkpoint_resumes_bitwise(split_run, tmp_path):
    ckpt = tmp_path / "ckpt"
    resumed = kill_after_checkpoint_then_resume(ckpt, [*ARGS, *SPLIT], 4)
    want, got = split_run.losses_by_step(), resumed.losses_by_step()
    assert [got[s] for s in range(5, 9)] == [want[s] for s in range(5, 9)]


def test_a_split_runs_checkpoint_resumes_on_its_gpus_without_the_split_and_on_one_through_the_universal_path(
        split_run, tmp_path):
    """2 ranks that split each sequence saved step 4. The same 2 GPUs as 2 data-parallel ranks of one block each (the
    same 2 blocks per step) resume it and train on as the split run did: ZeRO partitioned the states over both GPUs
    either way. One GPU resumes it through DeepSpeed's universal conversion, which reads a view of it that records
    no tensor parallelism (patches.deepspeed_checkpoint: DeepSpeed records Ulysses' group as tensor parallelism)."""
    source = tmp_path / "source" / "step-00000004"  # the conversion writes beside the checkpoint: a copy of it
    shutil.copytree(split_run.checkpoint_dir / "step-00000004", source)
    run = run_trainer(tmp_path / "ckpt", [*ARGS, "--micro_batch_size", "1", "--resume_from_checkpoint", str(source)])
    one = run_trainer(tmp_path / "one", [*ARGS, "--resume_from_checkpoint", str(source)], nproc=1)
    want = split_run.losses_by_step()
    for resumed in (run, one):
        assert_ok(resumed)
        got = resumed.losses_by_step()
        for step in range(5, 9):
            assert got[step] == pytest.approx(want[step], rel=RELATIVE), f"step {step}"
    assert "converting it to a universal checkpoint" in one.output and "step-00000004-view" in one.output
    assert (source.parent / "step-00000004-universal" / "converted").exists()
    assert not (source.parent / "step-00000004-view").exists()  # the view goes once the conversion is done
