"""A run in one file (--config FILE.yaml): flags by name, the command line overriding them, bad keys and values
refused naming the file, the key and the fix; the effective configuration a run writes, which reproduces the same
configuration; and the worked examples of configs/runs/, each checked by the preflight."""

from __future__ import annotations

import json

import pytest
import yaml
from conftest import REPO
from inputs import jsonl, refused_command_line

from model_utils.config import run_file
from model_utils.config.flags import parse_args
from model_utils.config.settings import SECTIONS, TrainConfig, flag_fields

EXAMPLES = sorted((REPO / "configs" / "runs").glob("*.yaml"))


def write(tmp_path, text: str):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return str(path)


def test_a_file_sets_flags_and_the_command_line_overrides_them(tmp_path):
    path = write(tmp_path, "model: qwen3-0.6b\nmax_steps: 20\nlearning_rate: 3e-4\ngradient_checkpointing: true\n"
                           "compile: off\nfused_kernels: on\nmodel_name_or_path: gpt2\n")
    cfg = parse_args(["--config", path, "--max_steps", "7", "--no-gradient_checkpointing"])
    assert cfg == parse_args(["--model", "gpt2", "--max_steps", "7", "--learning_rate", "3e-4", "--compile", "off",
                              "--fused_kernels", "on"])
    assert {"model", "max_steps", "learning_rate", "compile", "fused_kernels"} <= cfg.explicit  # the file's count too


def test_the_command_lines_length_replaces_the_files_other_length(tmp_path):
    """A file's --num_epochs and a command line's --max_steps: the command line's (it cannot unset the file's)."""
    path = write(tmp_path, "num_epochs: 3\ndataset: embedded-chat\n")
    assert parse_args(["--config", path, "--max_steps", "2"]) == parse_args(["--max_steps", "2", "--dataset",
                                                                              "embedded-chat"])
    assert parse_args(["--config", path, "--dummy_data", "64"]) == parse_args(["--num_epochs", "3", "--dummy_data",
                                                                                "64"])


@pytest.mark.parametrize("text, expected", [
    ("max_step: 3\n", "run.yaml: max_step = 3: is not a setting\n    fix: did you mean max_steps"),
    ("learning_rat: 1e-4\n", "run.yaml: learning_rat = 1e-4: is not a setting\n    fix: did you mean learning_rate?"),
    ("max_steps: 2.5\n", "run.yaml: max_steps = 2.5: invalid int value: '2.5'\n    fix: give max_steps a whole number, "
                         "e.g. max_steps: 300"),
    ("gradient_checkpointing: 1\n", "run.yaml: gradient_checkpointing = 1: is a switch: true or false\n    fix: write "
                                    "gradient_checkpointing: true or gradient_checkpointing: false"),
    ("compile: fast\n", "run.yaml: compile = fast: invalid choice: 'fast' (choose from 'auto', 'layers', 'off')\n"
                        "    fix: write compile: one of auto, layers, off"),
    ("tokenizer: yes\n", "run.yaml: tokenizer = True: is true/false, and tokenizer takes text\n    fix: quote it"),
    ("lora_target_modules: [q_proj, v_proj]\n", "run.yaml: lora_target_modules = ['q_proj', 'v_proj']: takes one "
                                                "value\n    fix: write one value (a list as one text with commas"),
    ("max_steps: null\n", "run.yaml: max_steps = None: has no value\n    fix: give it one, or leave max_steps out"),
    ("per_device_train_batch_size: 4\n", "run.yaml: per_device_train_batch_size = 4: is Hugging Face Trainer's; here "
                                         "--micro_batch_size counts packed blocks"),
    ("- max_steps\n", "--config = run.yaml: holds a list, not flags by name"),
    ("max_steps: [1\n", "--config = run.yaml: is not valid YAML at line 2"),
    ("1: x\n", "run.yaml: 1 = x: is not a flag's name (YAML read the key as int)"),
])
def test_a_bad_key_or_value_is_refused_naming_the_file_the_key_and_the_fix(text, expected, tmp_path, capsys):
    path = write(tmp_path, text)
    assert expected.replace("run.yaml", path) in refused_command_line(["--config", path], capsys)


def test_a_missing_file_is_refused(tmp_path, capsys):
    assert "--config = nope.yaml: file not found" in refused_command_line(["--config", "nope.yaml"], capsys)


def test_the_effective_configuration_runs_the_same_again(tmp_path):
    """The file a run writes holds every flag, values YAML would misread included (`on`, `yes`, `null` as text), and
    --config on it gives the same configuration, the flags counted as given included; a flag added overrides it."""
    args = ["--checkpoint_dir", str(tmp_path / "ckpt"), "--model", "qwen3-0.6b", "--learning_rate", "1e-4",
            "--compile", "off", "--fused_kernels", "on", "--local_dataset", "true", "--generate_prompt", "yes",
            "--tokenizer", "null", "--lora_rank", "8", "--lora_target_modules", "q_proj,v_proj",
            "--gradient_checkpointing", "--checkpointed_layers", "3", "--micro_batch_size", "auto", "--rope_scaling",
            "yarn:4", "--attention_dropout", "0.1", "--no-tensorboard", "--dataset", "embedded-chat"]
    cfg = parse_args([*args, "--num_epochs", "1.5"])
    path = run_file.write(cfg, "train_deepspeed.py --model qwen3-0.6b ...")
    assert path == tmp_path / "ckpt" / "config.yaml"
    written = yaml.safe_load(path.read_text())
    assert list(written) == [f.name for section in [*SECTIONS.values(), TrainConfig] for f in flag_fields(section)]
    assert parse_args(["--config", str(path)]) == cfg
    assert parse_args(["--config", str(path), "--max_steps", "9"]) == parse_args([*args, "--max_steps", "9"])


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_every_example_reads_cleanly(example):
    keys = yaml.safe_load(example.read_text())
    cfg = parse_args(["--config", str(example)])
    assert {k: cfg.flag(k) for k in keys} == {k: v for k, v in keys.items()}, json.dumps(keys)


def small_pretrained_model(tmp_path) -> str:
    """A local "pretrained" model with the project's tokenizer, in place of a hub model."""
    from transformers import Qwen3Config

    from model_utils.data.tokenizer import load_tokenizer

    path = tmp_path / "pretrained"
    Qwen3Config(vocab_size=8192, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16).save_pretrained(path)
    load_tokenizer(None).save_pretrained(path)
    return str(path)


def documents(tmp_path) -> str:
    path = tmp_path / "documents"
    path.mkdir()
    jsonl(path / "part-0.jsonl", [{"text": f"Document {i}: " + " ".join(f"w{(i * k) % 97}" for k in range(200))}
                                  for i in range(64)])
    return str(path)


# What each example needs to be checked here, offline: local data or a model in place of the hub's, and the GPUs
# (WORLD_SIZE, GPU_MEMORY_GIB) it plans for; then a line of its plan. A new example needs its entry.
OFFLINE = {
    "pretrain": (lambda tmp: ["--dataset", documents(tmp)], {"WORLD_SIZE": "8", "GPU_MEMORY_GIB": "80"},
                 "x world 8 = 128 blocks of 4096 tokens = 524,288 tokens/step"),
    "sft-lora": (lambda tmp: ["--model", small_pretrained_model(tmp)], {"WORLD_SIZE": "1", "GPU_MEMORY_GIB": "80"},
                 "epochs: 3 = "),
    "long-context": (lambda tmp: ["--model", "llama-8b", "--dataset", "embedded-chat"],
                     {"WORLD_SIZE": "2", "GPU_MEMORY_GIB": "80"}, "batch: micro 1 x grad_acc 1 x world 1 = 1 blocks of "
                                                                  "65536 tokens"),
}


def test_every_example_has_its_preflight():
    assert set(OFFLINE) == {path.stem for path in EXAMPLES}


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_the_preflight_passes_every_example(example, tmp_path, session_cache, monkeypatch, capsys):
    """The preflight of each example (in this process: no cold import), planned for the GPUs it is written for; the
    8B model's plan takes ~4 s on 2 cores, the chat corpus's first build ~3 s. The checkpoint disk is the cluster's
    the examples are written for, which this machine cannot be: 1 TiB free (the pretraining example keeps 4
    checkpoints of ~8 GiB, more than a test machine's /tmp may hold)."""
    import shutil

    import train_deepspeed

    offline, env, planned = OFFLINE[example.stem]
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    this_disk = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda path: this_disk(path)._replace(free=2**40))
    monkeypatch.chdir(tmp_path)
    code = train_deepspeed.main(["--preflight", "--config", str(example), *offline(tmp_path), "--checkpoint_dir",
                                 str(tmp_path / "ckpt")])
    out = capsys.readouterr().out
    assert code == 0 and "preflight: OK" in out, out
    assert planned in out, out
