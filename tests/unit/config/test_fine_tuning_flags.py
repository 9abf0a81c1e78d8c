"""The fine-tuning flags: their problems, what --data_format resolves to for a source, the fine-tuning defaults, and
LoRA's share of the memory estimate."""

from __future__ import annotations

import json

import pytest

from model_utils.config.checks import validate_args
from model_utils.config.flags import parse_args
from model_utils.config.settings import TrainConfig


def settings_of(problems) -> list[str]:
    return [p.setting for p in problems]


def test_a_pretrained_model_without_data_is_a_problem_naming_the_fix(tmp_path):
    problems = validate_args(TrainConfig.from_flags(model=str(tmp_path)))
    [problem] = [p for p in problems if p.setting == "--dataset"]
    assert "pretrained model" in problem.message and "--dataset embedded-chat" in problem.fix
    assert "--dataset" not in settings_of(validate_args(TrainConfig.from_flags(model="tiny")))  # a preset: embedded
    assert "--dataset" not in settings_of(validate_args(TrainConfig.from_flags(model=str(tmp_path),
                                                                               dataset="embedded-chat")))


def test_lora_and_epoch_flags_report_bad_values_and_combinations():
    assert "--lora_alpha" in settings_of(validate_args(parse_args(["--lora_alpha", "8"])))  # LoRA is off
    assert "--export_merged" in settings_of(validate_args(parse_args(["--export_merged"])))
    bad = validate_args(parse_args(["--lora_rank", "8", "--lora_dropout", "1.5", "--lora_target_modules", ","]))
    assert {"--lora_dropout", "--lora_target_modules"} <= set(settings_of(bad))
    assert "--lora_rank" in settings_of(validate_args(parse_args(["--lora_rank", "-1"])))
    both = validate_args(parse_args(["--num_epochs", "2", "--max_steps", "10"]))
    assert any(p.setting == "--num_epochs" and "both set the length" in p.message for p in both)
    assert "--num_epochs" in settings_of(validate_args(parse_args(["--num_epochs", "0"])))
    assert "--dataset" in settings_of(validate_args(parse_args(["--dataset", "embedded_chat"])))  # a typo
    assert not validate_args(parse_args(["--lora_rank", "8", "--num_epochs", "1.5", "--dataset", "embedded-chat"]))


def test_load_in_4bit_needs_lora_bitsandbytes_at_its_floor_and_refuses_what_it_does_not_take():
    from model_utils.config.checks import BITSANDBYTES_FLOOR, qlora_problems

    def problems(*flags, spec=object(), version="0.50.2"):
        return qlora_problems(parse_args(list(flags)), find_spec=lambda name: spec, version_of=lambda name: version)

    assert problems("--lora_rank", "16", "--load_in_4bit") == [] and problems("--lora_rank", "16") == []
    [alone] = problems("--load_in_4bit")
    assert alone.setting == "--load_in_4bit" and "LoRA is off" in alone.message and "--lora_rank 16" in alone.fix
    [missing] = problems("--lora_rank", "16", "--load_in_4bit", spec=None)
    assert "not installed" in missing.message and "'.[qlora]'" in missing.fix
    [old] = problems("--lora_rank", "16", "--load_in_4bit", version="0.46.1")
    assert "0.46.1 is installed" in old.message and BITSANDBYTES_FLOOR in old.fix
    refused = problems("--lora_rank", "16", "--load_in_4bit", "--sequence_parallel", "2", "--compile", "layers")
    assert settings_of(refused) == ["--sequence_parallel", "--compile"] and all(p.fix for p in refused)
    assert "--load_in_4bit" in settings_of(validate_args(parse_args(["--load_in_4bit"])))  # through the checks


def test_the_qlora_extra_names_the_floor_the_checks_hold():
    import tomllib

    from model_utils.config.checks import BITSANDBYTES_FLOOR
    from model_utils.core.repo import REPO_ROOT

    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    floor = f"bitsandbytes>={BITSANDBYTES_FLOOR}"
    assert floor in project["project"]["optional-dependencies"]["qlora"]
    assert "deepspeed-lm-trainer[qlora]" in project["project"]["optional-dependencies"]["test"]
    assert floor in project["dependency-groups"]["dev"]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


CHAT = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}


@pytest.mark.parametrize("row, requested, resolved", [
    (CHAT, "auto", "chat"),
    ({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}, "auto", "sharegpt"),
    ({"prompt": "a", "completion": "b"}, "auto", "prompt_completion"),
    ({"instruction": "a", "output": "b"}, "auto", "alpaca"),
    ({"input_ids": [1, 2], "labels": [-100, 2]}, "auto", "tokens"),
    ({"input_ids": [1, 2]}, "auto", "pretraining"),  # pre-tokenized text: concatenated as today
    ({"text": "a document"}, "auto", "pretraining"),
    ({"text": "a document"}, "text", "text"),  # explicit: examples kept apart
])
def test_the_data_format_follows_the_columns(tmp_path, row, requested, resolved):
    from model_utils.data.sft.formats import resolve_data_format
    from model_utils.data.sources import resolve_source

    cfg = TrainConfig.from_flags(dataset=str(write_jsonl(tmp_path / "data.jsonl", [row])),
                                 data_format=requested).data
    assert resolve_data_format(cfg, resolve_source(cfg)) == resolved


def test_an_explicit_format_without_its_columns_names_the_file_and_columns(tmp_path):
    from model_utils.data.errors import DataError
    from model_utils.data.sft.formats import resolve_data_format
    from model_utils.data.sources import resolve_source

    path = write_jsonl(tmp_path / "notes.jsonl", [{"text": "a"}])
    cfg = TrainConfig.from_flags(dataset=str(path), data_format="chat").data
    with pytest.raises(DataError) as raised:
        resolve_data_format(cfg, resolve_source(cfg))
    assert str(path) in str(raised.value.problem.value) and "columns: text" in raised.value.problem.message


def test_rows_of_no_format_and_no_text_name_the_text_column_and_every_format(tmp_path):
    from model_utils.data.errors import DataError
    from model_utils.data.sft.formats import resolve_data_format
    from model_utils.data.sources import resolve_source

    path = write_jsonl(tmp_path / "qa.jsonl", [{"question": "2+2?", "answer": "4"}])
    cfg = TrainConfig.from_flags(dataset=str(path)).data
    with pytest.raises(DataError) as raised:
        resolve_data_format(cfg, resolve_source(cfg))
    problem = raised.value.problem
    assert (problem.setting, problem.value) == ("--text_column", "text")
    assert str(path) in problem.message and "columns: question, answer" in problem.message
    for columns in ("chat: messages", "sharegpt: conversations", "prompt_completion: prompt + completion",
                    "alpaca: instruction + output", "tokens: input_ids"):
        assert columns in problem.fix


def test_fine_tuning_defaults_apply_to_a_pretrained_model_only(tmp_path):
    from model_utils.config.fine_tuning import with_fine_tuning_defaults

    pretrained = TrainConfig.from_flags(model=str(tmp_path), dataset="embedded-chat", max_steps=100)
    cfg, defaults = with_fine_tuning_defaults(pretrained, 100)
    assert (cfg.optim.learning_rate, cfg.optim.warmup_steps) == (2e-5, 3)
    cfg, _ = with_fine_tuning_defaults(dataclass_with(pretrained, lora_rank=8), 100)
    assert cfg.optim.learning_rate == 2e-4
    mine, _ = with_fine_tuning_defaults(dataclass_with(pretrained, learning_rate=1e-3), 100)
    assert (mine.optim.learning_rate, mine.optim.warmup_steps) == (1e-3, 3)  # the user's rate stays
    assert with_fine_tuning_defaults(TrainConfig.from_flags(model="tiny"), 100)[1] is None


def dataclass_with(cfg: TrainConfig, **flags) -> TrainConfig:
    return cfg.with_flags(**flags)


def test_lora_gets_a_larger_automatic_micro_batch_than_full_fine_tuning(tmp_path, monkeypatch):
    """The estimate counts the frozen weights' 16-bit copy only: the memory that frees goes to activations."""
    from transformers import Qwen3Config

    from model_utils.data.tokenizer import load_tokenizer
    from model_utils.planning.plan import make_plan

    tokenizer = load_tokenizer(None)
    Qwen3Config(vocab_size=8192, hidden_size=1024, intermediate_size=3072, num_hidden_layers=12,
                num_attention_heads=16, num_key_value_heads=8, head_dim=64).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    monkeypatch.setenv("GPU_MEMORY_GIB", "4")  # planning for a GPU: the estimate decides
    flags = dict(model=str(tmp_path), dataset="embedded-chat", micro_batch_size="auto", seq_len=1024,
                 global_batch_tokens=64 * 1024, checkpoint_dir=str(tmp_path / "ckpt"))
    full = make_plan(TrainConfig.from_flags(**flags), 1, decides=False)
    lora = make_plan(TrainConfig.from_flags(lora_rank=16, **flags), 1, decides=False)
    assert lora.model.frozen_params > 0 and lora.model.trainable_params < full.model.num_params / 10
    assert lora.memory.phases.train < full.memory.phases.train
    assert lora.batch.micro > full.batch.micro


def test_the_fine_tuning_defaults_are_not_reported_as_the_users_overrides(tmp_path):
    """The defaults fill the unset --learning_rate and --warmup_steps, which then differ from ds_config.json's values:
    the log's fine-tuning line states them, and no note calls them the user's flags overriding the config; a rate the
    user gives still gets that note."""
    from transformers import Qwen3Config

    from model_utils.data.tokenizer import load_tokenizer
    from model_utils.planning.plan import make_plan

    Qwen3Config(vocab_size=8192, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16).save_pretrained(tmp_path)
    load_tokenizer(None).save_pretrained(tmp_path)
    flags = dict(model=str(tmp_path), dataset="embedded-chat", lora_rank=8, max_steps=100,
                 checkpoint_dir=str(tmp_path / "ckpt"))
    defaults = make_plan(TrainConfig.from_flags(**flags), 1, decides=False)
    assert defaults.fine_tuning.filled == ("learning_rate", "warmup_steps")
    assert defaults.ds_config["optimizer"]["params"]["lr"] == 2e-4
    assert not [note for note in defaults.notes if "overrides" in note], defaults.notes
    assert defaults.fine_tuning.describe().startswith("fine-tuning defaults: learning rate 0.0002, 3 warmup steps")
    mine = make_plan(TrainConfig.from_flags(learning_rate=1e-3, **flags), 1, decides=False)
    assert mine.fine_tuning.filled == ("warmup_steps",)
    # the line states what it filled: the warm-up, not a rate the run does not train at
    assert mine.fine_tuning.describe().startswith("fine-tuning defaults: 3 warmup steps")
    assert "learning rate" not in mine.fine_tuning.describe().split("(")[0]
    assert [note for note in mine.notes if "overrides" in note] == [
        "--learning_rate 0.001 overrides optimizer.params.lr=0.0003 from the DeepSpeed config"]


def test_the_help_of_dataset_names_every_form_it_takes():
    """--help is where a user looks first: every kind of source data.sources.resolve_source reads is named there, and
    every fine-tuning format under --data_format."""
    import re

    from model_utils.config.flags import build_parser
    from model_utils.data.sft.formats import FORMATS
    from model_utils.data.sources import FILE_BUILDERS

    text = build_parser().format_help()
    help_text = " ".join(text[text.index("\n\n"):].split())  # after the usage lines: each flag and its help

    def flag_help(flag):
        return re.search(rf"{flag} \S+\s+(.*?)(?= --[a-z_]+ |$)", help_text).group(1)

    dataset = flag_help("--dataset")
    builders = {"text", "JSONL", "Parquet", "CSV", "Arrow"}
    assert len(set(FILE_BUILDERS.values())) == len(builders) and all(b in dataset for b in builders)
    for form in ("save_to_disk directory", "prepared by `python -m model_utils.prepare`", ".npy", "a:0.7,b:0.3",
                 "hub dataset name", "`embedded`", "`embedded-chat`"):
        assert form in dataset, form
    data_format = flag_help("--data_format")
    assert all(fmt in data_format for fmt in FORMATS)
