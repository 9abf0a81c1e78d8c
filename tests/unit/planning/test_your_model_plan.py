"""A model and a dataset of your own, and stages, as the preflight plans and refuses them (in process: the model is
built on the meta device, the data's first items collated, the forward run on the meta device). Each mistake of the
issue's list is a Problem naming the setting, the value and the fix, before anything starts."""

from __future__ import annotations

import json
import textwrap

import pytest
from conftest import REPO

from model_utils.config.flags import parse_args
from model_utils.planning.preflight import run_preflight

EXAMPLE = REPO / "examples" / "your-model"
MODEL = textwrap.dedent('''
    import torch
    from torch import nn

    class Tiny(nn.Module):
        def __init__(self, returns):
            super().__init__()
            self.encoder, self.head = nn.Linear(4, 4), nn.Linear(4, 2)
            self.returns = returns

        def forward(self, x, y):
            logits = self.head(self.encoder(x))
            if self.returns == "logits":
                return logits
            return {"loss": nn.functional.cross_entropy(logits, y)}

    def build(settings):
        return Tiny(settings.args.get("returns", "loss"))
    ''')
DATA = textwrap.dedent('''
    import torch

    def build(settings):
        ragged = settings.args.get("ragged", False)
        return [{"x": torch.ones(4 + (i % 2 if ragged else 0)), "y": torch.tensor(i % 2)} for i in range(40)]
    ''')


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("yours")
    (root / "model.py").write_text(MODEL)
    (root / "data.py").write_text(DATA)
    return root


def preflight(files, *flags, capsys=None):
    cfg = parse_args(["--model", f"{files / 'model.py'}:build", "--dataset", f"{files / 'data.py'}:build",
                      "--micro_batch_size", "2", "--checkpoint_dir", str(files / "ckpt"), *flags])
    report = run_preflight(cfg, world_size=1)
    return report, "\n".join(str(p) for p in report.problems)


def test_a_model_and_dataset_of_your_own_plan(files):
    report, problems = preflight(files, "--stages", json.dumps([{"name": "head", "steps": 2, "train": ["head"]},
                                                                 {"name": "all", "epochs": 1}]))
    assert not problems, problems
    lines = "\n".join(report.lines)
    assert "model of your own" in lines and "its groups: encoder (encoder), head (head)" in lines
    assert "data:" in lines and "40 training items" not in lines  # 1% held out of 40: 39 train
    assert "39 training items, 1 held out" in lines


@pytest.mark.parametrize("model, flags, expected", [
    ("model.py:nope", [], "defines no nope"),
    ("missing.py:build", [], "missing.py: no such file"),
    ("model.py:build", ["--model_args", '{"returns": "logits"}'], "its forward returned loss of shape (2, 2), not a "
                                                                  "scalar loss"),
    ("model.py:build", ["--data_args", '{"ragged": true}'], "its collate cannot batch train items"),
    ("model.py:build", ["--stages", '[{"name": "none", "steps": 2, "freeze": ["encoder", "head"]}]'],
     "freezes every group of the model: nothing would train"),
    ("model.py:build", ["--stages", '[{"name": "odd", "steps": 2, "train": ["decoder"]}]'],
     "names no group or module of the model"),
    ("model.py:build", ["--stages", '[{"name": "a", "step": 2}]'], "did you mean steps?"),
    ("model.py:build", ["--stages", '[{"name": "a", "steps": 2}]', "--max_steps", "5"], "the stages set it"),
    ("model.py:build", ["--lora_rank", "8"], "is not for a model of your own"),
])
def test_the_mistakes_of_your_own_code_are_problems_before_the_run(files, model, flags, expected):
    cfg_flags = ["--model", f"{files / model.split(':')[0]}:{model.split(':')[1]}"]
    report, problems = preflight(files, *cfg_flags, *flags)
    assert expected in problems, problems
    assert all(p.fix for p in report.problems)


def test_the_example_plans_its_three_stages():
    cfg = parse_args(["--model", f"{EXAMPLE / 'model.py'}:build", "--dataset", f"{EXAMPLE / 'data.py'}:build",
                      "--config", str(EXAMPLE / "stages.yaml"), "--data_args", '{"max_examples": 80}'])
    report = run_preflight(cfg, world_size=1)
    assert not report.problems, report.problems
    lines = "\n".join(report.lines)
    assert "(stage align)" in lines and "(stage language)" in lines


@pytest.mark.parametrize("model, stages, expected", [
    ("tiny", [{"name": "a", "steps": 2, "train": ["lm_head"]}, {"name": "b", "steps": 2, "freeze": ["model.layers.0"]}],
     None),
    ("tiny", [{"name": "a", "steps": 2, "train": ["decoder"]}], "names no group or module of the model"),
    ("tiny", [{"name": "a", "steps": 2, "freeze": ["model", "lm_head"]}], "nothing would train"),
    ("tiny-vl", [{"name": "a", "steps": 2, "train": ["projector"]}], None),
    ("tiny-vl", [{"name": "a", "steps": 2, "freeze": ["vision_tower", "projector", "language_model"]}],
     "nothing would train"),
])
def test_a_built_in_models_stages_are_checked_against_its_modules(tmp_path, model, stages, expected):
    cfg = parse_args(["--model", model, "--stages", json.dumps(stages), "--checkpoint_dir", str(tmp_path / "ckpt"),
                      "--micro_batch_size", "1"])
    problems = "\n".join(str(p) for p in run_preflight(cfg, world_size=1, check_data=False).problems)
    assert (expected in problems) if expected else not problems, problems
