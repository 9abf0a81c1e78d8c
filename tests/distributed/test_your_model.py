"""A model of your own in a curriculum of stages, through the trainer unchanged (real DeepSpeed on 2 CPU ranks):
examples/your-model (an image encoder feeding a small language model, plain torch.nn, no transformers config) with
its dataset file and three stages under ZeRO-3: the run killed (-9) inside stage 2 resumes there at the same item,
its losses equal to the uninterrupted run's bit for bit, each stage at its own learning rate, and its export
reloads (ZeRO-2: test_your_model_zero2.py). A built-in model takes stages by its parts."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import REPO, assert_ok, kill_after_checkpoint_then_resume, run_trainer

MODEL = str(REPO / "examples/your-model/model.py") + ":build"
DATA = str(REPO / "examples/your-model/data.py") + ":build"
STAGES = [{"name": "align", "steps": 3, "learning_rate": 1e-3, "train": ["projector"],
           "data_args": {"task": "captions"}},
          {"name": "language", "steps": 3, "learning_rate": 5e-4, "warmup_steps": 1,
           "train": ["projector", "language_model"]},
          {"name": "all", "steps": 3, "learning_rate": 2e-4, "decay": "linear"}]


def args(stages, *more):
    return ["--model", MODEL, "--dataset", DATA, "--data_args", json.dumps({"max_examples": 240}),
            "--model_args", json.dumps({"width": 32, "heads": 2}), "--seq_len", "24", "--micro_batch_size", "4",
            "--stages", json.dumps(stages), "--log_interval", "1", "--eval_interval", "0", "--eval_iters", "1", *more]


@pytest.fixture(scope="module")
def zero3(tmp_path_factory):
    """(the uninterrupted run, the run killed once step 4's checkpoint was complete and resumed): 9 steps in three
    stages under configs/zero3.json, checkpoints at the stage boundaries (3, 6) and every 4 steps."""
    return whole_and_resumed(tmp_path_factory.mktemp("your-model"),
                             args(STAGES, "--ds_config", "configs/zero3.json", "--checkpoint_freq", "4"))


def whole_and_resumed(root, flags):
    """(the run uninterrupted, the same run killed once step 4's checkpoint was complete and resumed)."""
    return (run_trainer(root / "whole", flags, timeout=300),
            kill_after_checkpoint_then_resume(root / "killed", flags, step=4))


def test_a_model_of_your_own_resumes_inside_its_stage_exactly(zero3):
    whole, resumed = zero3
    assert_ok(whole)
    assert "model of your own" in whole.output and "stage language: from step 4, its data from their start" in whole.output
    assert "resume: continuing from" in resumed.output and "step-00000004" in resumed.output
    losses, again = whole.losses_by_step(), resumed.losses_by_step()
    assert sorted(losses) == list(range(1, 10))
    assert [again[s] for s in range(5, 10)] == [losses[s] for s in range(5, 10)]  # bit for bit, across stage 3's start
    boundaries = sorted(int(p.name.split("-")[1]) for p in whole.checkpoint_dir.glob("step-*"))
    assert {3, 6, 9} <= set(boundaries) or boundaries[-1] == 9  # the stage ends saved (retention keeps the last)


def test_each_stage_trains_at_its_own_rate(zero3):
    whole, _ = zero3
    rates = {r["step"]: r["lr"] for r in whole.train_records()}
    assert rates[1] == rates[3] == pytest.approx(1e-3)  # align: constant
    assert rates[4] == pytest.approx(2.5e-4) and rates[5] == pytest.approx(5e-4)  # language: one warm-up step
    assert rates[7] == pytest.approx(2e-4) and rates[9] == pytest.approx(2e-4 / 3)  # all: linear to 0 by its end


def test_the_export_of_a_model_of_your_own_reloads(zero3, tmp_path):
    """The run's own export reloads; `python -m model_utils.export` of its last checkpoint (ZeRO-3's shards merged)
    writes the same weights."""
    import sys

    import preloaded
    from model_utils.models.custom.export import load_exported

    whole, _ = zero3
    model = load_exported(whole.checkpoint_dir / "hf")
    command = [sys.executable, "-m", "model_utils.export", str(whole.checkpoint_dir / "step-00000009"), "--output",
               str(tmp_path / "again"), "--dtype", "float32"]
    done = preloaded.run(command, cwd=REPO / "src", capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    again = dict(load_exported(tmp_path / "again").named_parameters())
    assert all(torch.equal(p, again[name]) for name, p in model.named_parameters())
    assert sum(p.numel() for p in model.parameters()) > 0
    item = {"pixels": torch.rand(2, 3, 32, 32), "input_ids": torch.randint(0, 100, (2, 24)),
            "labels": torch.randint(0, 100, (2, 24))}
    assert torch.isfinite(model(**item)["loss"])


def test_a_built_in_model_takes_stages_by_its_parts(tmp_path):
    """The tiny vision preset on its embedded pictures: the projector alone, then every part (the vision parts'
    names), each at its rate, to the end. At the preset's --seq_len, whose packed pictures the vision journey
    (test_vision_language.py) reads from the session's cache too: one of them packs them."""
    stages = [{"name": "projector", "steps": 2, "learning_rate": 2e-3, "train": ["projector"]},
              {"name": "all", "steps": 2, "learning_rate": 1e-3, "freeze": ["vision_tower"]}]
    run = run_trainer(tmp_path / "vl", ["--model", "tiny-vl", "--micro_batch_size", "2",
                                        "--stages", json.dumps(stages), "--log_interval", "1", "--eval_iters", "1",
                                        "--checkpoint_freq", "0", "--no-export"], timeout=300)
    assert_ok(run)
    assert "stage projector: 2 steps, lr 0.002, constant; trains projector" in run.output
    rates = {r["step"]: r["lr"] for r in run.train_records()}
    assert [rates[s] for s in (1, 2, 3, 4)] == pytest.approx([2e-3, 2e-3, 1e-3, 1e-3])
    assert "eval (final)" in run.output
