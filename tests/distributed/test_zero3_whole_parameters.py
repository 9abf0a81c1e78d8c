"""ZeRO-3's "auto" parameter persistence through the trainer on 2 CPU ranks. Planned for a GPU size with room for the
whole model (GPU_MEMORY_GIB: the one stand-in, no GPU here), every parameter stays whole on each rank; the run trains
step for step as the partitioned one (no GPU size: Hugging Face's 10 x hidden), exports the same weights, and resumes
exactly after kill -9. zero3_layers_run.py shows the same at the DeepSpeed level: nothing released after a backward."""

from __future__ import annotations

import pytest
import torch
from conftest import FAST_ARGS, assert_ok, kill_after_checkpoint_then_resume, run_trainer

ARGS = [*FAST_ARGS, "--ds_config", "configs/zero3.json", "--max_steps", "6", "--checkpoint_freq", "3", "--seed", "11"]
PLANNED_FOR_A_GPU = {"GPU_MEMORY_GIB": "80"}
WHOLE = "parameters: ZeRO-3 keeps every parameter whole on each GPU"  # the header's line, not a warning


def losses(run) -> list[float]:
    by_step = run.losses_by_step()
    return [by_step[step] for step in sorted(by_step)]


@pytest.fixture(scope="module")
def whole(session_cache, tmp_path_factory):
    run = run_trainer(tmp_path_factory.mktemp("whole") / "ckpt", ARGS, env=PLANNED_FOR_A_GPU)
    assert_ok(run)
    return run


def test_whole_parameters_train_and_export_as_partitioned_ones(whole, tmp_path):
    from transformers import AutoModelForCausalLM

    assert WHOLE in whole.output
    partitioned = run_trainer(tmp_path / "ckpt", ARGS)
    assert_ok(partitioned)
    assert WHOLE not in partitioned.output
    assert len(losses(whole)) == 6 and losses(whole) == losses(partitioned)
    ours = AutoModelForCausalLM.from_pretrained(whole.checkpoint_dir / "hf").state_dict()
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt" / "hf").state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    largest = max(tensor.numel() for tensor in ours.values())  # the embedding
    assert f'"auto" -> {largest:,} elements, the largest parameter' in whole.output


def test_whole_parameters_resume_exactly_after_kill_9(whole, tmp_path):
    resumed = kill_after_checkpoint_then_resume(tmp_path / "ckpt", ARGS, 3, env=PLANNED_FOR_A_GPU)
    assert WHOLE in resumed.output
    assert losses(resumed) == losses(whole)
