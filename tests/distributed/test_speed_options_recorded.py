"""The speed options of a real run (2 CPU ranks) are recorded where a user and a resume look for them: the run header,
summary.json and each checkpoint's manifest (the settings and what they resolved to on this machine). A resume with
a lever that changes the numerics, or a changed optimisation setting, says so and carries on."""

from __future__ import annotations

import json

from conftest import FAST_ARGS, assert_ok, run_trainer

from model_utils.config.settings import SpeedConfig


def test_options_are_recorded_and_a_changed_option_is_named_on_resume(session_cache, tmp_path):
    ckpt = tmp_path / "ckpt"
    args = [*FAST_ARGS, "--checkpoint_freq", "2", "--no-export"]
    first = run_trainer(ckpt, [*args, "--max_steps", "2"])
    assert_ok(first)
    assert '"speed": {"fused_kernels": "auto", "liger_kernels": "auto", "flce_chunk_budget": 8' in first.output
    manifest = json.loads((ckpt / "step-00000002" / "manifest.json").read_text())
    assert manifest["perf"] == SpeedConfig().as_dict()
    # No GPU: every lever takes the libraries' own path, and the record says so.
    in_force = {"fused_kernels": "off", "flce_chunk_budget": None, "compile": "off", "attention_kernel": "sdpa",
                "sdpa_backend": "auto", "overflow_check": "scan", "delayed_update_from_step": 0,
                "delayed_update_prefetch": "off"}
    assert manifest["levers_in_force"] == in_force
    summary = json.loads((ckpt / "summary.json").read_text())
    assert summary["speed_levers"] == {"settings": SpeedConfig().as_dict(), "in_force": in_force}

    same = run_trainer(ckpt, [*args, "--max_steps", "3"])
    assert_ok(same)
    assert "speed options that change the numerics differ" not in same.output
    # A longer run stretches the cosine decay: the resume names it, with the flag it comes from.
    assert ("the optimisation differs from the checkpoint's run (scheduler.params.total_num_steps: 2 -> 3 "
            "(--max_steps))") in same.output
    # Recomputing the first of the tiny model's 4 layers changes memory, not the numbers: resumed without a word.
    changed = run_trainer(ckpt, [*args, "--max_steps", "6", "--flce_chunk_budget", "4", "--overflow_check", "norm",
                                 "--gradient_checkpointing", "--checkpointed_layers", "1"])
    assert_ok(changed)
    assert "activation checkpointing: 1 of 4 decoder layers recompute" in changed.output
    assert ("speed options that change the numerics differ from the checkpoint's (flce_chunk_budget: 8 -> 4)"
            in changed.output)  # the overflow check skips the same steps in every mode: not named
    assert json.loads((ckpt / "step-00000004" / "manifest.json").read_text())["perf"]["flce_chunk_budget"] == 4
    # Its first step trains at the 6-step schedule's rate, as a 6-step run from the start does, not at the rate the
    # 3-step schedule ended with (the checkpoint's optimizer holds that one: its floor).
    whole = run_trainer(tmp_path / "whole", [*args, "--max_steps", "6"])
    assert_ok(whole)
    rates = [{line["step"]: line["lr"] for line in map(json.loads, (d / "metrics.jsonl").read_text().splitlines())
              if "lr" in line} for d in (ckpt, tmp_path / "whole")]
    assert rates[0][4] == rates[1][4] > rates[0][3], rates
