"""The stages as a run file writes them (config/stages.py) and the learning rate of each step (train/stages.py)."""

from __future__ import annotations

import math

import pytest

from model_utils.config.stages import read_stages, stage_bounds


def test_stages_read_as_written_and_their_lengths_follow_their_data():
    stages, problems = read_stages([{"name": "a", "steps": 10, "learning_rate": "1e-3", "train": "projector,head"},
                                    {"name": "b", "epochs": 1.5, "freeze": ["encoder"], "decay": "cosine"}])
    assert not problems
    assert stages[0].learning_rate == 1e-3 and stages[0].train == ("projector", "head")  # YAML's 1e-3 is text
    assert stages[1].freeze == ("encoder",) and stages[1].train is None
    assert stage_bounds(stages, [7, 8]) == [(0, 10), (10, 22)]  # 1.5 epochs of 8 steps


@pytest.mark.parametrize("entry, expected", [
    ({"name": "a"}, "needs its length"),
    ({"name": "a", "steps": 0}, "is not a positive whole number"),
    ({"name": "a", "steps": 5, "warmup_steps": 5}, "is not below the stage's 5 steps"),
    ({"name": "a", "steps": 5, "train": ["x"], "freeze": ["y"]}, "gives both train and freeze"),
    ({"name": "a", "steps": 5, "decay": "exp"}, "is not a decay"),
    ({"name": "a", "steps": 5, "train": []}, "trains nothing"),
    ("a", "not a mapping"),
])
def test_a_bad_stage_is_a_problem_naming_it(entry, expected):
    _, problems = read_stages([entry])
    assert any(expected in p.message for p in problems), problems


def test_each_step_takes_its_stage_rate():
    from model_utils.train.stages import Curriculum, StageSchedule

    stages, _ = read_stages([{"name": "a", "steps": 2, "learning_rate": 1.0, "warmup_steps": 1},
                             {"name": "b", "steps": 4, "learning_rate": 0.5, "decay": "cosine", "train": ["x"]}])
    groups = [{"lr": 0.0, "stage_mask": (True, True)}, {"lr": 0.0, "stage_mask": (True, False), "lr_scale": 2.0}]
    schedule = StageSchedule(type("Optimizer", (), {"param_groups": groups})(), Curriculum(stages, [(0, 2), (2, 6)]),
                             base_lr=9.0)
    rates = []
    for _ in range(6):
        schedule.step()
        rates.append([g["lr"] for g in groups])
    assert rates[0] == [0.5, 1.0] and rates[1] == [1.0, 2.0]  # warm-up, then the peak; the group at twice its rate
    assert rates[2] == [0.5, 0.0]  # stage b: the second group frozen (lr 0)
    assert rates[4][0] == pytest.approx(0.25 * (1 + math.cos(math.pi * 2 / 4)))
    schedule.load_state_dict({"last_batch_iteration": 1})
    assert [g["lr"] for g in groups] == [1.0, 2.0]  # a resume takes the checkpoint's iteration's rates
