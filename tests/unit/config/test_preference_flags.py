"""Preference tuning's flags: the objectives' defaults, every combination refused before a run with its fix, and what
a resume may change."""

from __future__ import annotations

import pytest

from model_utils.config.checks import validate_args
from model_utils.config.flags import parse_args
from model_utils.config.preference import (PreferenceSettings, preference_resume_problems, preference_settings,
                                           resume_changes)


@pytest.mark.parametrize("argv, expected", [
    ([], None),
    (["--preference", "dpo"], PreferenceSettings("dpo", 0.1)),
    (["--preference", "ipo", "--beta", "0.5"], PreferenceSettings("ipo", 0.5)),
    (["--preference", "simpo"], PreferenceSettings("simpo", 2.0, 0.5)),
    (["--preference", "simpo", "--simpo_gamma", "1.0"], PreferenceSettings("simpo", 2.0, 1.0)),
    (["--preference", "orpo"], PreferenceSettings("orpo", 0.1)),
])
def test_each_objective_takes_its_defaults_where_its_values_are_unset(argv, expected):
    cfg = parse_args(argv)
    assert not validate_args(cfg)
    assert preference_settings(cfg) == expected


@pytest.mark.parametrize("argv, setting, fix", [
    (["--beta", "0.2"], "--beta", "add --preference dpo"),
    (["--data_format", "preference"], "--data_format", "add --preference dpo"),
    (["--preference", "dpo", "--beta", "0"], "--beta", "--beta 0.1"),
    (["--preference", "ipo", "--simpo_gamma", "1"], "--simpo_gamma", "--preference simpo"),
    (["--preference", "dpo", "--data_format", "chat"], "--data_format", "--data_format preference"),
    (["--preference", "dpo", "--train_on_prompts"], "--train_on_prompts", "drop --train_on_prompts"),
    (["--preference", "dpo", "--dummy_data", "8"], "--dummy_data", "--dataset embedded-preference"),
    (["--preference", "dpo", "--dataset", "x", "--streaming"], "--streaming", "drop --streaming"),
    (["--preference", "dpo", "--document_mask"], "--document_mask", "drop --document_mask"),
    (["--preference", "dpo", "--sequence_parallel", "2"], "--sequence_parallel", "drop --sequence_parallel"),
])
def test_a_combination_that_cannot_run_is_refused_with_its_fix(argv, setting, fix):
    problems = [p for p in validate_args(parse_args(argv)) if p.setting == setting]
    assert len(problems) == 1 and fix in problems[0].fix, problems


def test_a_resume_keeps_its_objective_and_tells_other_values():
    dpo = PreferenceSettings("dpo", 0.1)
    recorded = dpo.as_manifest()
    assert preference_resume_problems(recorded, dpo, "ckpt") == []
    assert "was tuned with --preference dpo" in preference_resume_problems(recorded, PreferenceSettings("ipo", 0.1),
                                                                           "ckpt")[0].message
    assert "was trained without preference tuning" in preference_resume_problems(None, dpo, "ckpt")[0].message
    assert "--preference dpo" in preference_resume_problems(recorded, None, "ckpt")[0].fix
    assert resume_changes(recorded, PreferenceSettings("dpo", 0.2)) == ["beta: 0.1 -> 0.2"]
