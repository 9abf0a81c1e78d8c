"""One rank of a LoRA fine-tuning run under DeepSpeed ZeRO-2 on CPU (gloo), started by test_lora_zero2.py.

    python lora_zero2_run.py BASE_MODEL WORK_DIR train    # 4 steps, checkpoint after step 2, export at the end
    python lora_zero2_run.py BASE_MODEL WORK_DIR resume   # from the step-2 checkpoint, steps 3 and 4

The model is BASE_MODEL wrapped by model_utils.models.lora, the data chats packed by model_utils.data.sft.packing, the
optimizer groups models.build.decay_groups: the pieces the trainer wires. Rank 0 writes what the test checks to
WORK_DIR/<phase>.json. """

from __future__ import annotations

import json
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
sys.path.insert(0, str(SRC))

CHECKPOINT_STEP = 2
STEPS = 4
SEQ_LEN = 64
DS_CONFIG = {
    "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
    "steps_per_print": 1_000_000,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0, "torch_adam": True}},
    "zero_optimization": {"stage": 2},
}


def chats() -> list[dict]:
    return [{"messages": [{"role": "user", "content": f"What is {a} plus {b}?"},
                          {"role": "assistant", "content": f"{a} plus {b} is {a + b}."}]}
            for a in range(6) for b in range(4)]


def main(base_model: str, work_dir: str, phase: str) -> None:
    import deepspeed
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from model_utils.config.settings import LoraSettings
    from model_utils.data.blocks import BlockOrder, DataPosition
    from model_utils.data.sft.encode import ExampleEncoder, encode_rows
    from model_utils.data.sft.packing import PackedExamples, pack_examples
    from model_utils.data.tokenizer import load_tokenizer
    from model_utils.models.build import decay_groups
    from model_utils.models.lora import (adapter_state_dict, apply_lora, checkpoint_options, export_lora,
                                         parameter_counts)
    from model_utils.runtime.distributed import setup_distributed

    work = Path(work_dir)
    dist = setup_distributed()
    torch.manual_seed(0)
    tokenizer = load_tokenizer(None)
    packed = pack_examples(encode_rows(chats(), ExampleEncoder(tokenizer, "chat")), SEQ_LEN,
                           tokenizer.pad_token_id, len(tokenizer))
    data = PackedExamples(packed.inputs, packed.targets, packed.positions, SEQ_LEN)
    order = BlockOrder(np.arange(data.num_blocks), seed=3, world_size=dist.world_size, micro_batch=2)

    settings = LoraSettings(rank=4, alpha=8, dropout=0.0)
    model = apply_lora(AutoModelForCausalLM.from_pretrained(base_model, dtype=torch.float32), settings)
    matrices, others = decay_groups(model.parameters())
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=[{"params": matrices}, {"params": others}],
                                           config=DS_CONFIG)
    save_options, load_options = checkpoint_options()
    position, step, losses = DataPosition(), 0, []
    if phase == "resume":
        _, client = engine.load_checkpoint(str(work / "checkpoints"), tag=f"step-{CHECKPOINT_STEP}", **load_options)
        position, step = DataPosition.from_state_dict(client["data_position"]), client["step"]
        loaded_adapters = {k: v.clone() for k, v in adapter_state_dict(engine.module).items()}

    engine.train()
    while step < STEPS:
        indices = order.rank_indices(position, dist.rank)
        arrays = data.batch(indices).model_arrays()
        loss = engine(**{k: torch.from_numpy(v) for k, v in arrays.items()}, use_cache=False).loss
        engine.backward(loss)
        engine.step()
        position, step = order.advance(position), step + 1
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / dist.world_size)
        if phase == "train" and step == CHECKPOINT_STEP:
            engine.save_checkpoint(str(work / "checkpoints"), tag=f"step-{step}",
                                   client_state={"step": step, "data_position": position.state_dict()},
                                   **save_options)

    base = AutoModelForCausalLM.from_pretrained(base_model, dtype=torch.float32).state_dict()
    own = {k.replace("base_model.model.", "", 1).replace(".base_layer", ""): v
           for k, v in engine.module.state_dict().items() if "lora_" not in k}
    frozen_unchanged = all(torch.equal(own[k], base[k]) for k in base if k in own) and set(base) <= set(own)
    adapters_changed = all(v.abs().sum() > 0 for k, v in adapter_state_dict(engine.module).items() if "lora_B" in k)
    if dist.rank == 0:
        result = {"losses": losses, "frozen_unchanged": frozen_unchanged, "adapters_changed": adapters_changed,
                  "trainable": parameter_counts(engine.module).trainable}
        if phase == "resume":
            result["loaded_adapters"] = {k: v.tolist() for k, v in loaded_adapters.items()}
        if phase == "train":
            probe = torch.arange(1, 17).reshape(1, 16)
            engine.module.eval()
            with torch.no_grad():
                result["probe_logits"] = engine.module(probe).logits[0, -1].tolist()
            export_lora(engine.module, tokenizer, work / "export", merged=True)
        (work / f"{phase}.json").write_text(json.dumps(result))
    dist.barrier()


if __name__ == "__main__":
    main(*sys.argv[1:4])
