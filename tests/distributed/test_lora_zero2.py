"""LoRA under real DeepSpeed ZeRO-2 on 2 CPU ranks (lora_zero2_run.py): only the adapters train, the checkpoint holds
no frozen weight and resumes exactly, and the exports load in peft and in transformers alone."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import preloaded
from conftest import REPO, rank_environment, rendezvous_port


SCRIPT = Path(__file__).with_name("lora_zero2_run.py")


def run_ranks(base: Path, work: Path, phase: str, nproc: int = 2) -> None:
    port = rendezvous_port()
    logs = [work / f"{phase}-rank{r}.log" for r in range(nproc)]
    procs = [preloaded.Popen([sys.executable, str(SCRIPT), str(base), str(work), phase], cwd=REPO,
                             env=rank_environment(r, nproc, port), stdout=open(logs[r], "w"),
                             stderr=subprocess.STDOUT) for r in range(nproc)]
    codes = [p.wait(timeout=600) for p in procs]
    assert codes == [0] * nproc, "\n----\n".join(log.read_text()[-4000:] for log in logs)


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    from transformers import AutoModelForCausalLM, Qwen3Config

    from model_utils.data.tokenizer import load_tokenizer

    root = tmp_path_factory.mktemp("lora-zero2")
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=len(load_tokenizer(None)), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    AutoModelForCausalLM.from_config(config).save_pretrained(root / "base")  # the "pretrained" model
    run_ranks(root / "base", root, "train")
    run_ranks(root / "base", root, "resume")
    return root, json.loads((root / "train.json").read_text()), json.loads((root / "resume.json").read_text())


def test_only_the_adapters_change(lora_run):
    _, train, _ = lora_run
    assert train["frozen_unchanged"] and train["adapters_changed"]
    assert train["losses"][-1] < train["losses"][0]


def test_the_checkpoint_holds_the_adapters_and_their_optimizer_state_only(lora_run):
    root, train, _ = lora_run
    step = root / "checkpoints" / "step-2"
    module = torch.load(step / "mp_rank_00_model_states.pt", weights_only=False)["module"]
    assert module and all("lora_" in key for key in module)
    optimizer = torch.load(next(step.glob("*optim_states.pt")), weights_only=False)["optimizer_state_dict"]
    partitions = sum(t.numel() for t in optimizer["single_partition_of_fp32_groups"])
    assert train["trainable"] // 2 <= partitions <= train["trainable"] // 2 + 2  # rank 0's half (ZeRO-2)


def test_a_resume_continues_exactly(lora_run):
    _, train, resumed = lora_run
    assert resumed["losses"] == train["losses"][2:]
    assert resumed["frozen_unchanged"]


def test_exports_load_in_transformers_alone_and_in_peft(lora_run):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    root, train, _ = lora_run
    probe = torch.arange(1, 17).reshape(1, 16)
    expected = torch.tensor(train["probe_logits"])
    merged = AutoModelForCausalLM.from_pretrained(root / "export" / "merged").eval()
    adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(root / "base"),
                                        root / "export" / "adapter").eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(probe).logits[0, -1], expected, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(adapter(probe).logits[0, -1], expected, rtol=1e-5, atol=1e-5)


def test_the_offline_export_of_a_checkpoint_has_its_adapters(lora_run, tmp_path):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from model_utils.config.settings import LoraSettings
    from model_utils.models.lora import adapter_state_dict, export_lora_checkpoint

    root, _, resumed = lora_run
    fp32 = get_fp32_state_dict_from_zero_checkpoint(str(root / "checkpoints"), tag="step-2",
                                                    exclude_frozen_parameters=True)
    written = export_lora_checkpoint(str(root / "base"), LoraSettings(rank=4, alpha=8, dropout=0.0), fp32, None,
                                     tmp_path, merged=True)
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(root / "base"), written["adapter"])
    exported = adapter_state_dict(reloaded)
    assert exported.keys() == resumed["loaded_adapters"].keys()
    for key, value in resumed["loaded_adapters"].items():
        torch.testing.assert_close(exported[key], torch.tensor(value))
    assert (written["merged"] / "model.safetensors").exists()
