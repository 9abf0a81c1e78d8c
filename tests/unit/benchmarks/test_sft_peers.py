"""benchmarks/sft_peers.py's peers as `sft_bench.py --print-config` hands them over, on CPU without the peers
installed: each configured as its own documentation recommends (Unsloth's loader, adapters and notebook trainer;
axolotl's YAML with packed samples, FlashAttention, Liger and DeepSpeed; TRL + peft + bitsandbytes for QLoRA), with our
tokens per optimizer step and our LoRA settings."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))

SEQ_LEN, GLOBAL_TOKENS = 256, 2048
OUR_TARGETS = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]


PEERS = {"unsloth": ("lora", "qlora"), "axolotl": ("full", "lora"), "trl": ("lora", "qlora")}


@pytest.fixture(scope="module")
def configs(tmp_path_factory) -> dict:
    """What `sft_bench.py --peer PEER --modes ... --print-config` prints for each peer (one plan per mode)."""
    import contextlib
    import io

    import sft_bench

    printed = {}
    for peer, modes in PEERS.items():
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            code = sft_bench.main(["--peer", peer, "--modes", *modes, "--model", "tiny", "--seq_len", str(SEQ_LEN),
                                   "--micro_batch_size", "2", "--peer-micro-batch-size", "2", "4",
                                   "--global_batch_tokens", str(GLOBAL_TOKENS), "--nproc", "1", "--lora_dropout", "0",
                                   "--workdir", str(tmp_path_factory.mktemp(peer)), "--print-config"])
        assert code == 0
        text = out.getvalue()
        printed[peer] = json.loads(text[text.index("{"):])
    return printed


def test_unsloth_gets_its_loader_adapters_and_notebook_trainer_for_lora_and_qlora(configs):
    configs = configs["unsloth"]
    assert set(configs) == {"unsloth-lora-mb2-ga4", "unsloth-lora-mb4-ga2", "unsloth-qlora-mb2-ga4",
                            "unsloth-qlora-mb4-ga2", "note"}
    for name in ("unsloth-lora-mb4-ga2", "unsloth-qlora-mb4-ga2"):
        settings = configs[name]
        loader, adapters, trainer = settings["from_pretrained"], settings["get_peft_model"], settings["sft_config"]
        assert loader["load_in_4bit"] is ("qlora" in name) and loader["max_seq_length"] == SEQ_LEN
        assert adapters["use_gradient_checkpointing"] == "unsloth" and adapters["random_state"] == 3407
        assert (adapters["r"], adapters["lora_alpha"], adapters["lora_dropout"]) == (16, 32.0, 0.0)
        assert adapters["target_modules"] == OUR_TARGETS and adapters["bias"] == "none"
        assert trainer["optim"] == "adamw_8bit" and trainer["lr_scheduler_type"] == "linear" and trainer["packing"]
        assert trainer["assistant_only_loss"]  # the loss on the answers, as ours
        tokens = trainer["per_device_train_batch_size"] * trainer["gradient_accumulation_steps"] * SEQ_LEN
        assert tokens == GLOBAL_TOKENS and trainer["max_steps"] == 22  # 20 timed steps after 2 of warm-up
    assert "fine-tuning defaults" in configs["note"]


def test_axolotl_gets_packed_samples_flash_attention_liger_and_deepspeed_for_full_and_lora(configs):
    configs = configs["axolotl"]
    full, lora = configs["axolotl-full-mb4-ga2"]["config"], configs["axolotl-lora-mb4-ga2"]["config"]
    for config in (full, lora):
        assert config["sample_packing"] and config["flash_attention"] and config["sequence_len"] == SEQ_LEN
        assert config["plugins"] == ["axolotl.integrations.liger.LigerPlugin", "axolotl_timing.StepTiming"]
        assert all(config[kernel] for kernel in ("liger_rope", "liger_rms_norm", "liger_glu_activation",
                                                 "liger_fused_linear_cross_entropy"))
        assert config["micro_batch_size"] * config["gradient_accumulation_steps"] * SEQ_LEN == GLOBAL_TOKENS
        deepspeed = json.loads(Path(config["deepspeed"]).read_text())
        assert deepspeed["zero_optimization"]["stage"] == 2 and deepspeed["train_micro_batch_size_per_gpu"] == "auto"
        [dataset] = config["datasets"]
        assert dataset["type"] == "chat_template" and dataset["roles_to_train"] == ["assistant"]
    assert "adapter" not in full
    assert (lora["adapter"], lora["lora_r"], lora["lora_alpha"], lora["lora_target_linear"]) == ("lora", 16, 32, True)


def test_trl_peft_and_bitsandbytes_get_the_qlora_guides_settings_without_deepspeed(configs):
    configs = configs["trl"]
    qlora, lora = configs["trl-qlora-mb4-ga2"], configs["trl-lora-mb4-ga2"]
    assert qlora["quantization_config"] == {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4",
                                            "bnb_4bit_use_double_quant": True, "bnb_4bit_compute_dtype": "bfloat16"}
    assert qlora["peft_config"] == lora["peft_config"] and qlora["peft_config"]["target_modules"] == OUR_TARGETS
    assert qlora["sft_config"]["deepspeed"] is None and lora["sft_config"]["deepspeed"]["zero_optimization"]
    assert qlora["sft_config"]["model_init_kwargs"]["dtype"] == "bfloat16" and lora["quantization_config"] is None
    assert qlora["sft_config"]["packing"] and qlora["sft_config"]["use_liger_kernel"]


def test_a_mode_the_peer_does_not_run_is_refused_with_the_modes_it_runs(capsys, tmp_path):
    import sft_bench

    with pytest.raises(SystemExit):
        sft_bench.main(["--peer", "unsloth", "--modes", "full", "--workdir", str(tmp_path), "--print-config"])
    assert "--peer unsloth runs lora, qlora" in capsys.readouterr().err
