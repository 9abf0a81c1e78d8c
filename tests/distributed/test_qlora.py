"""QLoRA through the trainer on 2 CPU ranks (--load_in_4bit: bitsandbytes' CPU backend, fp32 compute) on a small
pretrained model: a ZeRO-2 run with gradient checkpointing, offloaded activations and an evaluation between its steps
lowers the loss, its checkpoints hold the adapters only, it resumes exactly after kill -9, its exports (the adapter on
the 4-bit base, the merged model on the dequantized base, the offline export) agree and generate; under ZeRO-3 the 4-bit
base is partitioned (stored as fp32, the MLPs' 4-bit weights pass the persistence threshold) and trains the same steps;
a resume that drops --load_in_4bit is refused with the fix."""

from __future__ import annotations

import json
import sys

import pytest
import torch
import preloaded
from conftest import REPO, SRC, assert_ok, kill_after_checkpoint_then_resume, require_bitsandbytes, run_trainer
from test_supervised_fine_tuning import SFT_ARGS, _env, base_model, chat_file  # noqa: F401 (the fixtures)

require_bitsandbytes()

QLORA_ARGS = [*SFT_ARGS, "--lora_rank", "4", "--lora_alpha", "8", "--lora_dropout", "0", "--learning_rate", "1e-2",
              "--load_in_4bit", "--max_steps", "4", "--checkpoint_freq", "2", "--eval_interval", "2",
              "--gradient_checkpointing", "--offload_activations", "--export_merged"]
PROBE = torch.arange(1, 17).reshape(1, 16)


@pytest.fixture(scope="module")
def qlora_runs(base_model, chat_file, session_cache, tmp_path_factory):  # noqa: F811 (pytest's fixture arguments)
    """The ZeRO-2 run whole and killed after its step-2 checkpoint then resumed; 2 steps of it under ZeRO-3."""
    root = tmp_path_factory.mktemp("qlora")
    args = [*QLORA_ARGS, "--model", str(base_model), "--dataset", str(chat_file)]
    whole = run_trainer(root / "whole", args)
    assert_ok(whole)
    resumed = kill_after_checkpoint_then_resume(root / "resumed", args, step=2)
    zero3 = run_trainer(root / "zero3", [*args, "--ds_config", "configs/zero3.json", "--max_steps", "2",
                                         "--eval_interval", "0", "--checkpoint_freq", "0"])
    assert_ok(zero3)
    return root, whole, resumed, zero3


def test_the_4bit_base_trains_the_adapters_and_lowers_the_loss(qlora_runs):
    _, whole, _, _ = qlora_runs
    assert "QLoRA: base in 4-bit NF4 with double quantization (bitsandbytes), computed in fp32, stored as uint8" \
        in whole.output
    assert "over a 4-bit base (QLoRA)" in whole.output and '"load_in_4bit": true' in whole.output  # the header
    losses = whole.losses_by_step()
    assert len(losses) == 4 and losses[4] < losses[1]
    assert "eval step 2:" in whole.output  # the steps after an evaluation train too (patches.bitsandbytes_cpu)


def test_the_checkpoint_holds_the_adapters_and_records_the_4bit_base(qlora_runs):
    root, _, _, _ = qlora_runs
    step = root / "whole" / "step-00000004"
    module = torch.load(step / "mp_rank_00_model_states.pt", weights_only=False)["module"]
    assert module and all("lora_" in key for key in module)  # no 4-bit weight, no quantization state
    assert json.loads((step / "manifest.json").read_text())["lora"]["load_in_4bit"] is True


def test_a_qlora_run_resumes_exactly_after_kill_9(qlora_runs):
    _, whole, resumed, _ = qlora_runs
    first = whole.losses_by_step()
    again = {step: loss for step, loss in resumed.losses_by_step().items() if step > 2}
    assert sorted(again) == [3, 4] and all(loss == pytest.approx(first[step], abs=1e-6) for step, loss in again.items())


def test_zero3_partitions_the_4bit_base_and_trains_the_same_steps(qlora_runs):
    _, whole, _, zero3 = qlora_runs
    assert "stored as float32 (ZeRO-3 partitions it)" in zero3.output
    losses = zero3.losses_by_step()
    assert sorted(losses) == [1, 2] and all(loss == pytest.approx(whole.losses_by_step()[s], abs=1e-5)
                                            for s, loss in losses.items())


def adapter_on_the_4bit_base(base_model, adapter):  # noqa: F811
    """The exported adapter on the base quantized as the run quantized it (on the CPU, fp32 compute)."""
    from peft import PeftModel

    from model_utils.models.quantization import Quantization, load_quantized, prepare_for_training

    base = load_quantized(str(base_model), None, Quantization("fp32", 2), "cpu")
    prepare_for_training(base)
    return PeftModel.from_pretrained(base, adapter).eval()


@pytest.mark.parametrize("run", ["whole", "zero3"])
def test_the_merged_export_is_the_adapter_on_the_dequantized_base(qlora_runs, base_model, run):  # noqa: F811
    """Plain transformers loads it (no 4-bit layer, no quantization_config), and it computes what the adapter computes
    on the 4-bit base (under ZeRO-3 its base was gathered from the ranks' partitions)."""
    from transformers import AutoModelForCausalLM

    root, _, _, _ = qlora_runs
    export = root / run / "hf"
    merged = AutoModelForCausalLM.from_pretrained(export / "merged").eval()
    assert "quantization_config" not in json.loads((export / "merged" / "config.json").read_text())
    assert all(type(m).__name__ != "Linear4bit" for m in merged.modules())
    with torch.no_grad():
        torch.testing.assert_close(merged(PROBE).logits, adapter_on_the_4bit_base(base_model, export / "adapter")(
            PROBE).logits, rtol=1e-4, atol=1e-4)


def test_the_offline_export_and_generate_on_both_exports(qlora_runs, capsys, tmp_path):
    from transformers import AutoModelForCausalLM

    from model_utils.generate import main as generate

    root, _, _, _ = qlora_runs
    offline = preloaded.run([sys.executable, "-m", "model_utils.export", str(root / "whole"), "--output",
                             str(tmp_path / "offline"), "--merged", "--dtype", "float32"], cwd=REPO,
                            env={"PYTHONPATH": str(SRC), **_env()}, capture_output=True, text=True, timeout=300)
    assert offline.returncode == 0, offline.stderr[-3000:]
    again, run = (AutoModelForCausalLM.from_pretrained(path / "merged").eval()
                  for path in (tmp_path / "offline", root / "whole" / "hf"))
    with torch.no_grad():
        torch.testing.assert_close(again(PROBE).logits, run(PROBE).logits, rtol=1e-4, atol=1e-4)
    for export in ("adapter", "merged"):  # the adapter's base is loaded in 4-bit (its base_quantization.json)
        generate(["--model", str(root / "whole" / "hf" / export), "--prompt", "What is 2 plus", "--max_new_tokens",
                  "4"])
        assert capsys.readouterr().out.startswith("What is 2 plus")


def test_a_resume_without_load_in_4bit_is_refused(qlora_runs, base_model, chat_file):  # noqa: F811
    root, _, _, _ = qlora_runs
    args = [a for a in QLORA_ARGS if a != "--load_in_4bit"]
    refused = run_trainer(root / "whole", [*args, "--model", str(base_model), "--dataset", str(chat_file)], nproc=1)
    assert refused.returncode == 2
    assert "--load_in_4bit = False" in refused.output and "trained its adapters on a 4-bit base" in refused.output
    assert "pass --load_in_4bit to resume it" in refused.output
