"""benchmarks/journey.sh's QLoRA journeys on CPU, the GPU runs played by a stand-in for ./train-singlenode.sh: qlora
(a T4's 15 GiB, fp16) and qlora-l40 (44 GiB, bf16) each reach their end (the kill after step 5, the resume from step
3 with the same losses, the merged export prompted), and every trainer command they start passes the trainer's own
plan at their GPU size, as the trainer checks it before it starts."""

from __future__ import annotations

import shlex
import subprocess

import pytest
from conftest import REPO
from launching import clean_env

# The stand-in launcher: the trainer's command as the real launcher's DRY_RUN prints it, after the GPU size it runs
# at; then the run's part of the journey: a first run logs steps 1 to 5 and waits for its kill, a run on a checkpoint
# directory with metrics resumes from step 3, trains steps 4 to 6 to the same losses and writes the merged export.
STAND_IN = r"""#!/usr/bin/env bash
set -euo pipefail
{ printf '%s ' "$GPU_MEMORY_GIB"; DRY_RUN=1 "$REAL_REPO/train-singlenode.sh" "$@" 2>&1 | grep '^+ '; } >>"$COMMANDS"
metrics=$CHECKPOINT_DIR/metrics.jsonl
step() { echo "{\"step\": $1, \"loss\": 9.$1, \"lr\": 0.0001, \"tokens_per_s\": 100}" >>"$metrics"; echo "step $1 loss 9.$1"; }
if [[ -e $metrics ]]; then
    echo "resume: continuing from $CHECKPOINT_DIR/step-00000003 at step 3"
    for s in 4 5 6; do step "$s"; done
    mkdir -p "$OUTPUT_DIR" && cp -r "$TINY_MODEL" "$OUTPUT_DIR/merged"
else
    mkdir -p "$CHECKPOINT_DIR"
    for s in 1 2 3 4 5; do step "$s"; done
    exec sleep 120  # killed by the journey after step 5
fi
"""


def model_directory(path, config):
    """A model directory as the journey's hf_model gives one: config.json and the tokenizer (no weights: the
    preflight plans on the meta device, and no step runs here)."""
    from model_utils.data.sft.formats import attach_chat_template
    from model_utils.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(None)
    attach_chat_template(tokenizer)
    config.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def journey(tmp_path_factory):
    """The two QLoRA journeys run from a copy of the repository whose ./train-singlenode.sh is the stand-in: its
    exit status, its journey.txt and the trainer commands, each as (GPU GiB, the trainer's flags). ~40 s: each
    journey starts the trainer's preflight and `python -m model_utils.generate` as real processes, as on a GPU."""
    import torch
    import transformers

    from model_utils.data.tokenizer import load_tokenizer
    from model_utils.models.build import model_config

    root = tmp_path_factory.mktemp("journey")
    repo = root / "repo"
    repo.mkdir()
    for name in ("benchmarks", "src", "configs", "scripts", "ds_config.json"):
        (repo / name).symlink_to(REPO / name)
    (repo / "train-singlenode.sh").write_text(STAND_IN)
    (repo / "train-singlenode.sh").chmod(0o755)
    torch.manual_seed(0)
    tiny = transformers.LlamaConfig(vocab_size=len(load_tokenizer(None)), hidden_size=32, intermediate_size=64,
                                    num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    model_directory(root / "tiny", tiny)
    transformers.AutoModelForCausalLM.from_config(tiny).save_pretrained(root / "tiny")
    commands = root / "commands.txt"
    done = subprocess.run(["bash", str(repo / "benchmarks" / "journey.sh")], cwd=root, capture_output=True, text=True,
                          timeout=300, env=clean_env(
                              JOURNEY_ONLY="qlora qlora-l40", JOURNEY_DIR=str(root / "out"), REAL_REPO=str(REPO),
                              JOURNEY_QLORA_MODEL=str(model_directory(root / "llama-8b", model_config("llama-8b"))),
                              TINY_MODEL=str(root / "tiny"), COMMANDS=str(commands), CUDA_VISIBLE_DEVICES=""))
    text = (root / "out" / "journey.txt").read_text() if (root / "out" / "journey.txt").exists() else ""
    runs = []
    for line in commands.read_text().splitlines():
        gib, _, command = line.partition(" + ")
        words = shlex.split(command)
        runs.append((gib, words[words.index("src/train_deepspeed.py") + 1:]))
    return done, text, runs


def test_both_qlora_journeys_reach_their_end(journey):
    """Each journey's plan, kill, resume from step 3, losses compared and merged export prompted, at its own GPU size
    and precision."""
    done, text, runs = journey
    assert done.returncode == 0, done.stdout + done.stderr + text
    lines = text.splitlines()
    for name in ("qlora", "qlora-l40"):
        assert f"journey {name} preflight: preflight: OK" in lines, text
        assert f"journey {name}-killed: SIGKILL after its pattern, as planned" in text, text
        resume = next(line for line in lines if line.startswith(f"journey {name}-resume: "))
        assert "exit 0" in resume and "resumed from 3" in resume, text
        assert f"journey {name}: step 4 loss 9.40000 killed, 9.40000 resumed, step 5 loss" in text, text
        assert f"/out/{name}-hf/merged --chat" in done.stdout, done.stdout
    assert [(gib, flags[flags.index("--ds_config") + 1]) for gib, flags in runs] == [
        ("15", "configs/fp16.json"), ("15", "configs/fp16.json"), ("44", "ds_config.json"), ("44", "ds_config.json")]


def test_every_run_of_the_qlora_journeys_passes_the_trainers_plan_at_its_gpu_size(journey, monkeypatch, capsys):
    """The trainer refuses at its start what its preflight refuses: the resume's --generate_prompt was refused at 15
    GiB (the sample loads the merged export beside the engine, ~21 GiB), so the journey never reached its end."""
    import train_deepspeed

    _, _, runs = journey
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("WORLD_SIZE", "1")
    for gib, flags in runs:
        monkeypatch.setenv("GPU_MEMORY_GIB", gib)
        code = train_deepspeed.main(["--preflight", *flags])
        out = capsys.readouterr().out
        assert code == 0, f"{gib} GiB: {' '.join(flags)}\n{out}"
