"""The flags users already type: Hugging Face Trainer's names taken where they mean the same (the same configuration as
this trainer's flag), refused otherwise (the message names the flag to use), DeepSpeed's launcher's bare --deepspeed,
and every other unknown flag or stray value answered in a line naming the closest flags, exit status 2, no usage."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from conftest import REPO, TRAINER
from inputs import refused_command_line

from model_utils.config.flags import parse_args
from model_utils.config.hf_names import HF_NAMES, Alias, Always, Refused
from model_utils.config.settings import TrainConfig
from model_utils.core.exit_status import BAD_INPUT

# The names issue 74 lists: each must have an answer here.
NAMED_IN_THE_ISSUE = ("deepspeed", "model_name_or_path", "per_device_train_batch_size", "num_train_epochs",
                      "output_dir", "logging_steps", "save_steps", "warmup_ratio", "bf16", "report_to", "eval_steps",
                      "save_total_limit", "max_seq_length", "max_length", "dataset_name", "fp16", "lr_scheduler_type",
                      "per_device_eval_batch_size", "do_train", "overwrite_output_dir", "torch_compile")

# A value each of our flags takes that is not its default.
VALUES = {"model": "gpt2", "ds_config": "configs/zero3.json", "num_epochs": "2.5", "log_interval": "5",
          "eval_interval": "50", "checkpoint_freq": "25", "keep_last_checkpoints": "2", "seq_len": "512",
          "dataset": "allenai/c4", "text_column": "content", "num_proc": "4", "lora_rank": "8"}


def test_every_name_of_the_issue_has_an_answer():
    assert set(NAMED_IN_THE_ISSUE) <= set(HF_NAMES)


@pytest.mark.parametrize("name", sorted(name for name, entry in HF_NAMES.items() if isinstance(entry, Alias)))
def test_an_accepted_name_is_our_flag(name):
    flag = HF_NAMES[name].flag
    value = VALUES[flag]
    ours = parse_args([f"--{flag}", value])
    assert ours.flag(flag) != TrainConfig().flag(flag)  # the value changes the setting
    assert parse_args([f"--{name}", value]) == ours
    assert parse_args([f"--{name}={value}"]) == ours


@pytest.mark.parametrize("name", sorted(name for name, entry in HF_NAMES.items() if isinstance(entry, Always)))
def test_a_name_for_what_this_trainer_always_does_changes_nothing_and_cannot_turn_it_off(name, capsys):
    assert parse_args([f"--{name}"]) == parse_args([f"--{name}", "True"]) == parse_args([])
    err = refused_command_line([f"--{name}", "false"], capsys)
    assert f"--{name} = false: cannot be turned off" in err and HF_NAMES[name].instead in err


@pytest.mark.parametrize("name", sorted(name for name, entry in HF_NAMES.items() if isinstance(entry, Refused)))
def test_a_refused_name_names_our_flag(name, capsys):
    err = refused_command_line([f"--{name}", "4", "--max_steps", "10"], capsys)
    assert f"  - --{name} = 4: is Hugging Face Trainer's; here " in err
    assert f"--{HF_NAMES[name].flag}" in err, err
    assert err.count("  - ") == 1  # the value went with the name; --max_steps 10 was taken


def test_deepspeed_takes_a_file_or_is_the_launchers_bare_switch(capsys):
    zero1 = parse_args(["--ds_config", "configs/zero1.json"])
    assert parse_args(["--deepspeed", "configs/zero1.json"]) == zero1
    assert parse_args(["--deepspeed", "--deepspeed_config", "configs/zero1.json"]) == zero1  # DeepSpeed's launcher
    assert parse_args(["--deepspeed", "--local_rank=0"]) == parse_args([])
    err = refused_command_line(["--deepspeed", '{"train_batch_size": 8}'], capsys)
    assert "is a JSON text" in err and "--ds_config FILE" in err


def test_a_step_count_trainer_would_read_as_a_ratio_is_refused_command_line(capsys):
    err = refused_command_line(["--logging_steps", "0.1"], capsys)
    assert "--logging_steps = 0.1: 0.1 is a ratio of the run's steps" in err and "whole number of steps" in err


@pytest.mark.parametrize("argv, expected", [
    (["--lerning_rate", "1e-3"], "  - --lerning_rate = 1e-3: is not a flag of this trainer\n    fix: did you mean "
                                 "--learning_rate?"),
    (["--max_stepz=5"], "  - --max_stepz = 5: is not a flag of this trainer\n    fix: did you mean --max_steps"),
    (["--gradient_checkpointing", "True"], "  - --gradient_checkpointing = True: is a switch and takes no value\n"
                                           "    fix: write --gradient_checkpointing alone to turn it on, "
                                           "--no-gradient_checkpointing to turn it off"),
    (["--lora_target_modules", "q_proj", "v_proj"], "  - --lora_target_modules = v_proj: takes one value"),
    (["--max_steps", "ten"], "  - --max_steps = ten: invalid int value: 'ten'"),
    (["--compile", "fast"], "  - --compile = fast: invalid choice: 'fast'"),
])
def test_unknown_flags_and_bad_values_get_one_problem_each(argv, expected, capsys):
    assert expected in refused_command_line(argv, capsys)


@pytest.mark.parametrize("argv, expected", [
    (["--learning_rat", "1e-4"], "--learning_rat = 1e-4: is not a flag of this trainer\n    fix: did you mean "
                                 "--learning_rate?"),  # argparse's prefix matching took it as --learning_rate
    (["--max_step=5"], "--max_step = 5: is not a flag of this trainer\n    fix: did you mean --max_steps"),
    (["--no-gradient_checkpoint"], "--no-gradient_checkpoint = True: is not a flag of this trainer\n    fix: did you "
                                   "mean --no-gradient_checkpointing"),
    (["--conf", "run.yaml"], "--conf = run.yaml: is not a flag of this trainer\n    fix: did you mean --config"),
    (["--per_device_train_batch", "4"], "--per_device_train_batch = 4: is not a flag of this trainer\n    fix: did "
                                        "you mean --per_device_train_batch_size"),  # a Trainer name's prefix
    (["--max", "3"], "--max = 3: is not a flag of this trainer\n    fix: python src/train_deepspeed.py --help"),
])
def test_a_flag_is_its_whole_name_and_a_prefix_is_a_misspelling(argv, expected, capsys):
    """No abbreviations: a flag cut short is not taken as the flag it starts, but answered as a misspelling is, with
    the nearest flags, in one problem."""
    err = refused_command_line(argv, capsys)
    assert err.startswith("error: 1 problem(s) with the inputs") and f"\n  - {expected}" in err, err


def test_the_command_line_stops_with_status_2_before_anything_starts():
    """The entry point as users run it, with the flags of a Trainer command: status 2, the problems, no usage dump."""
    done = subprocess.run([sys.executable, str(TRAINER), "--deepspeed", "ds_config.json", "--model_name_or_path",
                           "gpt2", "--per_device_train_batch_size", "4", "--bf16", "True"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == BAD_INPUT, done.stderr
    assert done.stderr.startswith("error: 2 problem(s) with the inputs; nothing was started:")
    assert "--micro_batch_size" in done.stderr and "--ds_config" in done.stderr and "usage:" not in done.stderr


SECTION = "Hugging Face Trainer's flags"


def test_the_documented_table_is_this_one():
    """docs/CONFIGURATION.md's table of Trainer names against HF_NAMES: each name is in a row that gives its answer and
    names the same flag."""
    text = (REPO / "docs/CONFIGURATION.md").read_text().split(f"\n## {SECTION}\n")[1].split("\n## ")[0]
    rows = {name: answer.strip() for names, answer in re.findall(r"^\| (`--[^|]+) \| ([^|]+) \|", text, re.M)
            for name in re.findall(r"`--([a-z0-9_]+)`", names)}
    assert set(rows) == set(HF_NAMES), (sorted(set(rows) - set(HF_NAMES)), sorted(set(HF_NAMES) - set(rows)))
    for name, entry in HF_NAMES.items():
        answer = rows[name]
        if isinstance(entry, Alias):
            assert answer == f"taken: `--{entry.flag}`", (name, answer)
        elif isinstance(entry, Always):
            assert answer == "taken: always so", (name, answer)
        else:
            assert answer == f"refused: `--{entry.flag}`", (name, answer)
