"""ds_config.json loading: "auto" resolution, overrides, batch arithmetic, and messages that name the fix."""

from __future__ import annotations

import copy
import json

import pytest
from conftest import REPO

from model_utils.config.checks import validate_args
from model_utils.config.deepspeed import load_json
from model_utils.config.flags import parse_args
from model_utils.config.settings import TrainConfig
from model_utils.planning.preflight import resolve

SHIPPED = json.loads((REPO / "ds_config.json").read_text())
PRESETS = sorted((REPO / "configs").glob("*.json"))


def problems_text(problems):
    return "\n".join(str(p) for p in problems)


def test_shipped_config_resolves_cleanly_and_fills_run_values():
    cfg = parse_args(["--max_steps", "200"])
    ds, notes, problems = resolve(SHIPPED, cfg, world_size=2, hardware="fp32", hidden_size=192)
    assert problems == [] and notes == []
    assert SHIPPED["train_micro_batch_size_per_gpu"] == "auto"  # no GPU memory known: 8 blocks, accumulation 1
    assert ds["train_micro_batch_size_per_gpu"] == 8 and ds["train_batch_size"] == 8 * 1 * 2
    assert ds["scheduler"]["params"]["total_num_steps"] == 200
    assert ds["scheduler"]["params"]["warmup_num_steps"] == 10  # "auto": 5% of max_steps
    assert ds["bf16"]["enabled"] is False and "fp16" not in ds  # "auto" on CPU: fp32
    assert SHIPPED["scheduler"]["params"]["total_num_steps"] == "auto"  # the input is not modified


def test_a_resume_names_what_changed_in_the_optimisation():
    """A resume compares the checkpoint's resolved config (its manifest's) with this run's: a longer --max_steps
    stretches the cosine decay, another world size without --global_batch_tokens changes the batch; each is named with
    the flag it comes from. The same settings, or another world size at the same global batch, name nothing."""
    from model_utils.config.deepspeed import optimisation_changes

    def resolved(args, world=2):
        ds, _, problems = resolve(SHIPPED, parse_args(args), world, hardware="fp32", seq_len=256)
        assert problems == []
        return json.loads(json.dumps(ds))  # as a manifest holds it

    saved = resolved(["--max_steps", "200"])
    assert optimisation_changes(saved, resolved(["--max_steps", "200"])) == []
    assert optimisation_changes(saved, resolved(["--max_steps", "400"])) == [
        "scheduler.params.total_num_steps: 200 -> 400 (--max_steps)",
        "scheduler.params.warmup_num_steps: 10 -> 20 (--warmup_steps, or 5% of --max_steps)"]
    assert optimisation_changes(saved, resolved(["--max_steps", "200"], world=4)) == [
        "train_batch_size: 16 -> 32 (micro-batch x accumulation x ranks; --global_batch_tokens keeps it)"]
    tokens = ["--max_steps", "200", "--global_batch_tokens", "8192", "--micro_batch_size", "4"]
    assert optimisation_changes(resolved(tokens), resolved(tokens, world=4)) == []  # accumulation 4 -> 2, same batch
    changed = optimisation_changes(saved, resolved(["--max_steps", "200", "--learning_rate", "1e-4"]))
    assert changed == ["optimizer.params.lr: 0.0003 -> 0.0001 (--learning_rate)"]
    assert optimisation_changes({}, saved) == []  # a checkpoint without the config in its manifest


def test_bf16_auto_turns_on_where_supported():
    ds, _, problems = resolve(SHIPPED, parse_args([]), 1, hardware="bf16")
    assert ds["bf16"]["enabled"] is True and problems == [] and "fp16" not in ds


def test_bf16_auto_becomes_fp16_with_dynamic_loss_scaling_on_gpus_without_bf16():
    """A T4 or V100 (the seeds' template targets T4): the capability is a stand-in here, there is no GPU."""
    from model_utils.config.deepspeed import hardware_precision, precision

    assert hardware_precision(cuda=True, bf16=False) == "fp16"
    assert hardware_precision(cuda=True, bf16=True) == "bf16" and hardware_precision(False, False) == "fp32"
    ds, notes, problems = resolve(SHIPPED, parse_args([]), 1, hardware="fp16")
    assert problems == [] and precision(ds) == "fp16"
    assert ds["bf16"]["enabled"] is False
    assert ds["fp16"]["enabled"] is True and ds["fp16"]["loss_scale"] == 0  # 0: dynamic
    assert any("fp16 with dynamic loss scaling" in n for n in notes)
    # An explicit bf16 there is refused with the fix; an fp16 section the config writes is kept as written.
    raw = copy.deepcopy(SHIPPED)
    raw["bf16"]["enabled"] = True
    _, _, problems = resolve(raw, parse_args([]), 1, hardware="fp16")
    assert [p.setting for p in problems] == ["bf16.enabled"] and '"auto"' in problems[0].fix
    raw = copy.deepcopy(SHIPPED)
    raw["fp16"] = {"enabled": "auto", "initial_scale_power": 12}
    ds, _, _ = resolve(raw, parse_args([]), 1, hardware="fp16")
    assert ds["fp16"] == {"enabled": True, "initial_scale_power": 12} and ds["bf16"]["enabled"] is False


def test_fp16_preset_trains_in_fp16_on_gpus_and_fp32_on_cpu():
    from model_utils.config.deepspeed import precision

    raw, _ = load_json(REPO / "configs" / "fp16.json")
    for hardware, expected in (("bf16", "fp16"), ("fp16", "fp16"), ("fp32", "fp32")):
        ds, _, problems = resolve(raw, parse_args([]), 1, hardware=hardware)
        assert problems == [] and precision(ds) == expected, hardware
    raw["fp16"]["enabled"] = True
    _, _, problems = resolve(raw, parse_args([]), 1, hardware="fp32")
    assert [p.setting for p in problems] == ["fp16.enabled"]


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.stem)
def test_every_preset_resolves(preset):
    raw, problems = load_json(preset)
    ds, _, problems = resolve(raw, parse_args([]), 2, "fp32", hidden_size=1024)
    assert problems == [], problems_text(problems)
    if ds["zero_optimization"]["stage"] == 3:
        assert ds["zero_optimization"]["reduce_bucket_size"] == 1024 * 1024


def test_auto_values_take_flags_and_flags_override_concrete_values():
    raw = copy.deepcopy(SHIPPED)
    raw["train_micro_batch_size_per_gpu"] = "auto"
    raw["gradient_accumulation_steps"] = 1
    cfg = parse_args(["--micro_batch_size", "3", "--learning_rate", "1e-3", "--gradient_accumulation_steps", "4"])
    ds, notes, problems = resolve(raw, cfg, 2, "fp32")
    assert problems == []
    assert ds["train_micro_batch_size_per_gpu"] == 3 and ds["train_batch_size"] == 3 * 4 * 2
    assert ds["optimizer"]["params"]["lr"] == 1e-3
    assert any("--learning_rate 0.001 overrides optimizer.params.lr=0.0003" in n for n in notes)
    assert any("gradient_accumulation_steps" in n for n in notes)


def test_seed_readme_config_names_the_right_scheduler_key():
    """The seeds' config spells the cosine floor `cosine_min_ratio`: DeepSpeed would die with a bare TypeError."""
    raw = copy.deepcopy(SHIPPED)
    raw["scheduler"] = {"type": "WarmupCosineLR",
                        "params": {"warmup_min_ratio": 0.0, "warmup_num_steps": 10, "cosine_min_ratio": 0.0}}
    _, _, problems = resolve(raw, parse_args([]), 1, "fp32")
    text = problems_text(problems)
    assert "scheduler.params.cosine_min_ratio" in text and "did you mean `cos_min_ratio`?" in text


@pytest.mark.parametrize("mutate,setting,fix", [
    (lambda d: d.update(train_batch_size=7), "train_batch_size", '"train_batch_size": "auto"'),
    (lambda d: d["optimizer"]["params"].update(weight_decy=0.1), "optimizer.params.weight_decy", "`weight_decay`"),
    (lambda d: d["optimizer"]["params"].update(max_grad_norm=1.0), "optimizer.params.max_grad_norm", "gradient_clipping"),
    (lambda d: d["scheduler"].update(type="WarmupCosine"), "scheduler.type", "`WarmupCosineLR`"),
    (lambda d: d["scheduler"]["params"].update(warmup_num_steps=5000), "scheduler.params.warmup_num_steps", "lower it"),
    (lambda d: d.update(bf16={"enabled": True}), "bf16.enabled", '"auto"'),
    (lambda d: d.update(train_micro_batch_size_per_gpu=0), "train_micro_batch_size_per_gpu", "1 or more"),
    (lambda d: d.update(gradient_clipping="auto", foo={"bar": "auto"}), "foo.bar", "concrete value"),
])
def test_bad_config_values_name_setting_and_fix(mutate, setting, fix):
    raw = copy.deepcopy(SHIPPED)
    mutate(raw)
    _, _, problems = resolve(raw, parse_args(["--max_steps", "300"]), 2, hardware="fp32")
    matching = [p for p in problems if p.setting == setting]
    assert matching, problems_text(problems)
    assert fix in str(matching[0])


def test_invalid_json_names_line_and_column(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{\n  "train_micro_batch_size_per_gpu": 4,\n}\n')
    data, problems = load_json(path)
    assert data is None and "line 3 column 1" in str(problems[0])


def test_validate_args_reports_every_problem_at_once(tmp_path):
    cfg = TrainConfig.from_flags(max_steps=0, seq_len=1, log_interval=0, ds_config=str(tmp_path / "missing.json"),
                      dataset=str(tmp_path / "nope"), local_dataset="true", learning_rate=-1.0, max_documents=-5)
    settings = {p.setting for p in validate_args(cfg)}
    assert {"--max_steps", "--seq_len", "--log_interval", "--ds_config", "--dataset", "--learning_rate",
            "--max_documents"} <= settings


def test_explicit_flags_are_tracked():
    cfg = parse_args(["--max_steps", "300", "--micro_batch_size", "2"])
    assert "micro_batch_size" in cfg.explicit and "max_steps" not in cfg.explicit  # 300 is the default


def test_batch_arithmetic_is_stated_once():
    """Micro-batch, accumulation, world size and block length from the resolved config, as the trainer's header, the
    preflight and the benchmark print and use them."""
    from model_utils.config.batch import Batch

    batch = Batch.of({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 8}, world=2, seq_len=4096)
    assert (batch.blocks_per_step, batch.tokens_per_step, batch.tokens_per_rank_step) == (64, 262_144, 131_072)
    assert batch.describe() == "micro 4 x grad_acc 8 x world 2 = 64 blocks of 4096 tokens = 262,144 tokens/step"
    assert batch.plan(10) == "10 steps = 2,621,440 tokens"
    assert batch.plan(10, train_tokens=1_310_720) == "10 steps = 2,621,440 tokens (2.00 epochs)"


def test_global_batch_in_tokens_derives_accumulation_for_any_world_size():
    """--global_batch_tokens states the batch once: on 1, 2 or 4 ranks the step holds the same tokens, accumulation
    makes up the difference, and a concrete accumulation in the config gives way with a note."""
    from model_utils.config.batch import Batch

    cfg = parse_args(["--global_batch_tokens", "8192", "--micro_batch_size", "4"])
    for world, accumulation in ((1, 8), (2, 4), (4, 2)):
        ds, notes, problems = resolve(SHIPPED, cfg, world, "fp32", seq_len=256)
        assert problems == [] and notes == []
        batch = Batch.of(ds, world, 256)
        assert (batch.accumulation, batch.tokens_per_step, ds["train_batch_size"]) == (accumulation, 8192, 32)
    raw = dict(copy.deepcopy(SHIPPED), gradient_accumulation_steps=1, train_batch_size=4)
    ds, notes, problems = resolve(raw, cfg, 2, "fp32", seq_len=256)
    assert problems == [] and ds["gradient_accumulation_steps"] == 4
    assert any("overrides train_batch_size=4" in n for n in notes)
    assert any("gradient_accumulation_steps=1 replaced by 4, derived from --global_batch_tokens 8,192" in n for n in notes)
    # The config's own train_batch_size is a global batch too: accumulation "auto" is derived from it.
    ds, _, problems = resolve(dict(copy.deepcopy(SHIPPED), train_batch_size=48), parse_args(["--micro_batch_size", "3"]),
                              2, "fp32", seq_len=256)
    assert problems == [] and ds["gradient_accumulation_steps"] == 8
    # A global batch that no micro-batch on this many ranks divides, and one that is not whole blocks: refused.
    _, _, problems = resolve(SHIPPED, cfg, 3, "fp32", seq_len=256)
    assert [p.setting for p in problems] == ["--global_batch_tokens"]
    assert "32 blocks per step is not a multiple of micro-batch 4 x world size 3" in str(problems[0])
    _, _, problems = resolve(SHIPPED, parse_args(["--global_batch_tokens", "1000"]), 1, "fp32", seq_len=256)
    assert "use a multiple of 256, e.g. 768 or 1024" in str(problems[0])


def test_automatic_micro_batch_is_the_largest_that_fits_and_divides_the_global_batch():
    from model_utils.models.memory import AUTO_MEMORY_SHARE, GIB, choose_micro_batch

    per_block = 5 * GIB  # a stand-in estimate: 10 GiB of model states and 5 GiB per block
    peak = lambda micro: 10 * GIB + per_block * micro  # noqa: E731
    micro, why = choose_micro_batch(4096, 80, peak, lambda m: True)
    assert micro == int((AUTO_MEMORY_SHARE * 80 - 10) // 5) == 12 and "the largest that fits 90% of 80 GiB" in why
    assert choose_micro_batch(4096, 80, peak, lambda m: 40 % m == 0)[0] == 10  # it divides the global batch
    assert choose_micro_batch(4096, 1000, peak, lambda m: True)[0] == 16  # the cap: 65,536 tokens per micro-batch
    assert choose_micro_batch(4096, 12, peak, lambda m: True)[0] == 1  # nothing fits: the preflight says so
    assert choose_micro_batch(4096, None, None, lambda m: 12 % m == 0)[0] == 6  # no GPU known: at most 8


def test_micro_batch_flag_takes_auto_or_a_count():
    assert parse_args(["--micro_batch_size", "auto"]).batch.micro_batch_size == "auto"
    assert parse_args(["--micro_batch_size", "4"]).batch.micro_batch_size == 4
    with pytest.raises(SystemExit):
        parse_args(["--micro_batch_size", "four"])
    assert [p.setting for p in validate_args(parse_args(["--micro_batch_size", "0", "--global_batch_tokens", "0"]))] \
        == ["--micro_batch_size", "--global_batch_tokens"]


def test_a_partial_offload_is_checked_and_sized_as_deepspeed_splits_it(monkeypatch):
    """`zero_optimization.offload_optimizer.ratio`: DeepSpeed reads it under ZeRO-3 with its CPU Adam only, so
    elsewhere it would do nothing (and the host would still have to hold every optimizer state): a problem. Where it
    applies, the GPU keeps the first floor((1 - ratio) n) of the rank's n optimizer sub-groups."""
    from model_utils import patches
    from model_utils.config.deepspeed import gpu_optimizer_share, zero3_sub_groups

    zero3 = json.loads((REPO / "configs" / "zero3-offload.json").read_text())
    zero2 = json.loads((REPO / "configs" / "zero2-offload.json").read_text())
    cases = [(zero2, 0.5, "under ZeRO-3 only (stage 2 here)"), (zero3, 1.5, "from 0 to 1"),
             (zero3, "half", "from 0 to 1")]
    for raw, ratio, message in cases:
        raw = copy.deepcopy(raw)
        raw["zero_optimization"]["offload_optimizer"]["ratio"] = ratio
        _, _, problems = resolve(raw, parse_args([]), 1, "bf16", 64, check_classes=False, seq_len=64)
        [problem] = [p for p in problems if p.setting == "zero_optimization.offload_optimizer.ratio"]
        assert message in str(problem) and "fix:" in str(problem)
    raw = copy.deepcopy(zero3)
    raw["zero_optimization"]["offload_optimizer"]["ratio"] = 0.5
    raw["optimizer"]["params"]["torch_adam"] = True
    _, _, problems = resolve(raw, parse_args([]), 1, "bf16", 64, check_classes=False, seq_len=64)
    assert any("torch_adam" in str(p) for p in problems if p.setting.endswith("ratio"))

    # Sub-groups: a group whole where it fits, else cut after the parameter that fills one; ZeRO-3 partitions first.
    groups = [[100] * 10, [5] * 3]
    assert zero3_sub_groups(groups, 1, 250) == [300, 300, 300, 100, 15]
    assert zero3_sub_groups(groups, 2, 1e9) == [500, 9]
    raw = copy.deepcopy(zero3)
    raw["zero_optimization"].update(sub_group_size=250)
    raw["zero_optimization"]["offload_optimizer"]["ratio"] = 0.5
    ds, notes, problems = resolve(raw, parse_args([]), 1, "bf16", 64, check_classes=False, seq_len=64)
    assert not problems, problems_text(problems)
    assert gpu_optimizer_share(ds, groups, 1) == 600 / 1015  # 2 of 5 sub-groups stay on the GPU
    # DeepSpeed's ZeRO-3 state_dict holds its CPU Adam's state only; patches.deepspeed_zero3 adds the GPU part's on the
    # releases it was tested with, and on others the run is told that a resume will not be exact.
    assert not [n for n in notes if "does not continue exactly" in n], notes
    monkeypatch.setattr(patches, "installed", lambda distribution: "0.17.0")
    _, notes, _ = resolve(raw, parse_args([]), 1, "bf16", 64, check_classes=False, seq_len=64)
    assert any("ratio 0.5" in n and "does not continue exactly" in n for n in notes), notes
    raw["zero_optimization"]["offload_optimizer"]["ratio"] = 1.0
    assert gpu_optimizer_share(resolve(raw, parse_args([]), 1, "bf16", 64, check_classes=False, seq_len=64)[0], groups, 1) == 0


def test_the_delayed_update_is_refused_where_it_would_do_nothing_or_change_what_it_does_not_cover():
    """--delayed_update_from_step defers ZeRO's CPU-offloaded update (DeepSpeed's CPU AdamW state, bf16 or fp32): a
    config without that update, parameters swapped to NVMe, another optimizer, or fp16's loss scaling is a problem
    naming the flag."""
    offload = json.loads((REPO / "configs" / "zero2-offload.json").read_text())
    zero3_offload = json.loads((REPO / "configs" / "zero3-offload.json").read_text())
    flag = ["--delayed_update_from_step", "3"]

    def delayed_problems(raw, hardware="bf16", argv=flag):
        _, _, problems = resolve(raw, parse_args(argv), 1, hardware, 64, check_classes=False, seq_len=64)
        return [str(p) for p in problems if p.setting == "--delayed_update_from_step"]

    assert delayed_problems(offload) == [] and delayed_problems(offload, argv=[]) == []
    assert delayed_problems(offload, hardware="fp32") == []
    [no_offload] = delayed_problems(SHIPPED)
    assert "ZeRO stage 2, optimizer offload none" in no_offload and "configs/zero2-offload.json" in no_offload
    assert delayed_problems(zero3_offload) == []
    raw = copy.deepcopy(zero3_offload)
    raw["zero_optimization"]["offload_optimizer"]["ratio"] = 0.5
    assert delayed_problems(raw) == []  # a partial offload: its GPU part is delayed alike
    raw["zero_optimization"]["offload_param"] = {"device": "nvme", "nvme_path": "/local"}
    [nvme] = delayed_problems(raw)
    assert "offload_param.device nvme" in nvme and "fix:" in nvme
    raw = copy.deepcopy(zero3_offload)
    raw["zero_optimization"]["offload_optimizer"] = {"device": "nvme", "nvme_path": "/local"}
    assert "optimizer offload nvme" in delayed_problems(raw)[0]
    for key, value in (("torch_adam", True), ("adam_w_mode", False)):
        raw = copy.deepcopy(offload)
        raw["optimizer"]["params"][key] = value
        [problem] = delayed_problems(raw)
        assert key in problem and "fix:" in problem
    raw = copy.deepcopy(offload)
    raw["optimizer"] = {"type": "Lamb", "params": {"lr": 1e-3}}
    assert "Lamb" in delayed_problems(raw)[0]
    raw = copy.deepcopy(offload)
    raw["bf16"] = {"enabled": False}
    raw["fp16"] = {"enabled": True}
    assert any("fp16's dynamic loss scaling" in p for p in delayed_problems(raw, hardware="fp16"))
    assert validate_args(parse_args(["--delayed_update_from_step", "-1"]))


def test_an_untested_deepspeed_keeps_its_own_offload_step(monkeypatch):
    """On a DeepSpeed release the delayed update was not tested with, the engine keeps its own step and the log
    says the flag is not applied."""
    from model_utils import patches
    from model_utils.patches.deepspeed_offload import delay_offload_updates

    monkeypatch.setattr(patches, "installed", lambda distribution: "0.18.0")
    said = []
    assert delay_offload_updates(object(), 3, said.append) is False
    assert any("outside 0.19.8-0.19.8" in s for s in said) and any("not applied" in s for s in said), said
    assert delay_offload_updates(object(), 0, said.append) is False
