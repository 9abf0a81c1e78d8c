"""One rank of a ZeRO-3 run on CPU (gloo) whose decoder layers are eager or compiled, started by
test_zero3_compiled_layers.py.

    python zero3_layers_run.py WORK_DIR eager|compiled|compiled-checkpointed|compiled-whole

The model is a tiny Qwen3 built under zero.Init; `compiled` applies models.speed._compile_layers as the trainer does
under ZeRO-3 (each layer a ZeRO-3 leaf module, its forward compiled, the hooks outside the graph; the trainer does so on
GPUs only: here the same graphs run on Dynamo's aot_eager backend); `compiled-checkpointed` also recomputes each layer in
the backward pass (--gradient_checkpointing); `compiled-whole` keeps every parameter whole on each rank (the persistence
threshold at the largest parameter, as planning.memory_model.choose_whole_parameters writes it). Rank 0 writes the
losses, the final weights (gathered), what the hooks cover and which parameters ZeRO-3 released after a micro-batch's
backward (from the second step on) to WORK_DIR/<mode>.json. """

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
sys.path.insert(0, str(SRC))

STEPS = 4
SEQ_LEN = 32
MICRO = 2
DS_CONFIG = {
    "train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
    "steps_per_print": 1_000_000,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0, "torch_adam": True}},
    # a prefetch bucket of one layer's parameters, as planning/plan.py writes for compiled layers under ZeRO-3
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 60_000},
}


def main(work_dir: str, mode: str) -> None:
    import deepspeed
    import torch
    from deepspeed.utils import z3_leaf_module
    from transformers import AutoModelForCausalLM, Qwen3Config
    from transformers.integrations import HfDeepSpeedConfig

    from model_utils.models import speed
    from model_utils.models.build import enable_activation_checkpointing
    from model_utils.runtime.distributed import setup_distributed

    dist = setup_distributed()
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False,
                         use_cache=False)
    config._attn_implementation = "sdpa"
    ds = dict(DS_CONFIG, train_batch_size=MICRO * 2 * dist.world_size)
    if mode.endswith("whole"):
        largest = config.vocab_size * config.hidden_size  # the embedding and the LM head
        ds["zero_optimization"] = dict(ds["zero_optimization"], stage3_param_persistence_threshold=largest)
    context = HfDeepSpeedConfig(ds)  # noqa: F841  (zero.Init while the model is built, as the trainer does)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if mode.startswith("compiled"):
        # Dynamo's capture and AOTAutograd's forward and backward graphs, as the trainer compiles them; the eager
        # backend runs those graphs instead of generating code for them (Inductor's CPU code is not what runs on a GPU,
        # and building its C++ took most of this test's minute).
        torch.compile = functools.partial(torch.compile, backend="aot_eager")
        assert speed._compile_layers(model, 1.0, print, zero3=True)
    if mode.endswith("checkpointed"):  # as models.build.build_model enables it
        enable_activation_checkpointing(model)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds)

    generator = torch.Generator().manual_seed(1)
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    losses, released = [], set()
    for step in range(STEPS):
        for _ in range(2):  # accumulation
            ids = torch.randint(0, config.vocab_size, (dist.world_size, MICRO, SEQ_LEN), generator=generator)
            batch = ids[dist.rank]
            loss = engine(input_ids=batch, labels=batch).loss
            engine.backward(loss)
            if step > 0:  # DeepSpeed's first step records the modules' order and releases every parameter after it
                released |= {name for name, p in model.named_parameters()
                             if p.ds_status == ZeroParamStatus.NOT_AVAILABLE}
            engine.step()
            losses.append(loss.item())

    layer = model.model.layers[0]
    weights = {}
    for name, param in model.named_parameters():
        with deepspeed.zero.GatheredParameters([param]):
            weights[name] = param.detach().double().sum().item()
    if dist.rank == 0:
        from torch._dynamo.utils import counters

        (Path(work_dir) / f"{mode}.json").write_text(json.dumps({
            "losses": losses, "weights": weights,
            "layer_is_leaf": z3_leaf_module(layer),
            "hooked_projection": hasattr(layer.self_attn.q_proj, "ds_id"),
            "graphs": counters["stats"]["unique_graphs"],
            "released": sorted(released), "parameters": len(weights),
        }))
    dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
