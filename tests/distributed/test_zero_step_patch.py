"""The ZeRO-1/2 step's patches (model_utils/patches/deepspeed_zero.py) against DeepSpeed's own step, for real: bf16
ZeRO-2 on CPU (gloo), one and two ranks."""

from __future__ import annotations

import json
import subprocess
import sys

import preloaded
from conftest import SRC, rendezvous_port


# Runs in a fresh process (DeepSpeed initialises torch.distributed): bf16 ZeRO-2 on CPU, the same optimizer class and
# step() as on GPUs (torch's fused AdamW, as ds_config.json), with a warm-up LR schedule so that every scheduler step
# shows. A NaN loss first, a finite step, an inf in one gradient tensor only (a hook on the last layer's bias), then a
# finite step: all overflow checks must skip the same steps, with the same LR afterwards, and leave bitwise-equal
# parameters. The loop's booking of a step the GPU skipped (--overflow_check device) is the trainer's:
# device_skip_flag, then settle_device_skip.
OVERFLOW_SCRIPT = r"""
import json, os, sys, torch
rank, world = (int(a) for a in (sys.argv[4:6] if len(sys.argv) > 4 else (0, 1)))
os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                  MASTER_PORT=sys.argv[2])
sys.path.insert(0, sys.argv[3])
import deepspeed
from model_utils.patches import deepspeed_zero
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
ds = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 0.05,
      "bf16": {"enabled": True, "check_grad_overflow": True},
      "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True, "fused": True}},
      "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 1e-3, "warmup_max_lr": 1e-2,
                                                    "warmup_num_steps": 8, "warmup_type": "linear"}},
      "zero_optimization": {"stage": 2}}
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds)
streamlined = deepspeed_zero.streamline_zero_step(engine, sys.argv[1], lambda message: None)
poison = {"on": False}
engine.module[2].bias.register_hook(lambda g: g.masked_fill(torch.ones_like(g, dtype=torch.bool), float("inf"))
                                    if poison["on"] and rank == world - 1 else g)  # the last rank's gradient only
x = torch.randn(2 * world, 16, dtype=torch.bfloat16)[2 * rank:2 * rank + 2]  # each rank its own batch
steps, norms = [], []
for kind in ("nan_loss", "finite", "inf_in_one_tensor", "finite"):  # the first step skipped, too
    before = [p.detach().clone() for p in engine.module.parameters()]
    poison["on"] = kind == "inf_in_one_tensor"
    loss = engine(x).float().pow(2).mean() * (float("nan") if kind == "nan_loss" else 1.0)
    engine.backward(loss)
    engine.step()
    if deepspeed_zero.device_skip_flag(engine, "cpu").item() > 0:
        deepspeed_zero.settle_device_skip(engine)
    updated = any(not torch.equal(a, b) for a, b in zip(before, engine.module.parameters()))
    steps.append({"kind": kind, "updated": updated, "skipped_steps": engine.skipped_steps,
                  "applied": engine.was_step_applied(), "lr": engine.get_lr()[0]})
    norms.append(float(engine.get_global_grad_norm()))
params = [p.detach().float().flatten().tolist() for p in engine.module.parameters()]
patched = sorted(k for k in ("check_overflow", "scaled_global_norm")
                 if k in vars(engine.optimizer))
print("RESULT " + json.dumps({"streamlined": streamlined, "patched": patched, "steps": steps, "params": params,
                              "norms": norms}))
"""


def _run(mode: str, world: int = 1) -> list[dict]:
    port = str(rendezvous_port())
    procs = [preloaded.Popen([sys.executable, "-c", OVERFLOW_SCRIPT, mode, port, str(SRC), str(rank), str(world)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in range(world)]
    outputs = [p.communicate(timeout=240) for p in procs]
    lines = [next((x for x in out.splitlines() if x.startswith("RESULT ")), None) for out, _ in outputs]
    assert all(lines), "\n".join(out[-2000:] + err[-3000:] for out, err in outputs)
    return [json.loads(line[len("RESULT "):]) for line in lines]


def test_patched_zero_step_skips_and_clips_like_deepspeed():
    scan, norm, device = (_run(mode)[0] for mode in ("scan", "norm", "device"))
    assert (scan["streamlined"], norm["streamlined"], device["streamlined"]) == ("scan", "norm", "device")
    assert (scan["patched"], norm["patched"]) == ([], ["check_overflow"])
    assert device["patched"] == ["check_overflow", "scaled_global_norm"]
    assert [s["updated"] for s in norm["steps"]] == [False, True, False, True]
    assert [s["applied"] for s in norm["steps"]] == [False, True, False, True]
    lrs = [s["lr"] for s in scan["steps"]]
    assert lrs[0] == lrs[1] == lrs[2] < lrs[3]  # the skipped steps did not advance the warm-up
    assert norm["steps"] == scan["steps"] == device["steps"]
    assert norm["steps"][-1]["skipped_steps"] == 2
    assert norm["params"] == scan["params"] == device["params"]  # bitwise: the same updates, clipped alike
    assert device["norms"] == norm["norms"]  # inf where skipped, as DeepSpeed reports
    # The clipping threshold (0.05) is below the norms, so the update depends on the norm's value.
    assert all(scan["norms"][i] > 0.05 for i, s in enumerate(scan["steps"]) if s["updated"])


def test_gpu_skipped_step_is_skipped_on_every_rank():
    """Two ranks (gloo), each its own batch; the inf is in the last rank's gradient only. With the verdict on the
    device every rank must skip the same steps as with DeepSpeed's host check, and the replicas stay identical."""
    host, device = _run("norm", world=2), _run("device", world=2)
    assert [s["updated"] for s in host[0]["steps"]] == [False, True, False, True]
    for rank in (0, 1):
        assert device[rank]["steps"] == host[rank]["steps"] == host[0]["steps"]
        assert device[rank]["params"] == host[rank]["params"] == host[0]["params"]
