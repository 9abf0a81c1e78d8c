"""The delayed parameter update of ZeRO CPU offload (model_utils/patches/deepspeed_offload.py, the trainer's
--delayed_update_from_step), for real: DeepSpeed ZeRO-1, ZeRO-2 and ZeRO-3 with the optimizer offloaded, bf16, on CPU
(gloo)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import preloaded
from conftest import (FAST_ARGS, SRC, assert_ok, gpu_count, gpu_environment, kill_after_checkpoint_then_resume,
                      rendezvous_port, run_trainer)


# Runs in a fresh process (DeepSpeed initialises torch.distributed). "delayed": the patch from step 1. "reference":
# DeepSpeed's own offload step with torch's fused AdamW on the host (the kernel the patch's thread runs), the model's
# weights set before each step to those of one step earlier: gradients taken one step late, by hand. Both clip
# (gradient_clipping 0.05 is below the norms here) and accumulate two micro-batches (in fp32 on the GPU or, as
# DeepSpeed does by default, in bf16 through host memory). ZeRO-3 offloads the parameters too, keeps the biases
# gathered (persistent) and splits each rank's partition into sub-groups; "partial" offloads half of them and, since a
# CPU machine has no GPU to keep the other half on, labels the first sub-group as on the GPU after the engine is built
# (DeepSpeed then steps it with its own torch AdamW, as on a GPU). Its reference steps the offloaded part with
# DeepSpeedCPUAdam, which DeepSpeed requires there and which rounds unlike torch's kernel.
SCRIPT = r"""
import json, os, sys, torch
os.environ.update(RANK=sys.argv[5], WORLD_SIZE="2", LOCAL_RANK=sys.argv[5], MASTER_ADDR="127.0.0.1",
                  MASTER_PORT=sys.argv[2])
sys.path.insert(0, sys.argv[3])
import deepspeed
from model_utils.patches import deepspeed_offload
mode = sys.argv[1]
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
                            torch.nn.Linear(64, 4))
params = {"lr": 1e-2, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}
stage, partial = int(sys.argv[4]), sys.argv[7] == "partial"
if mode == "reference" and not partial:
    params.update(torch_adam=True, fused=True)
ds = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "gradient_clipping": 0.05,
      "bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": sys.argv[6]},
      "optimizer": {"type": "AdamW", "params": params},
      "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 1e-3, "warmup_max_lr": 1e-2,
                                                    "warmup_num_steps": 4, "warmup_type": "linear"}},
      "zero_optimization": {"stage": stage, "offload_optimizer": {"device": "cpu"}}}
if stage == 3:
    ds["zero_optimization"].update(offload_param={"device": "cpu"}, sub_group_size=2000,
                                   stage3_param_persistence_threshold=100)
    if partial:
        ds["zero_optimization"]["offload_optimizer"]["ratio"] = 0.5
decay = [p for p in model.parameters() if p.dim() > 1]
others = [p for p in model.parameters() if p.dim() <= 1]
groups = [{"params": decay, "weight_decay": 0.1}, {"params": others, "weight_decay": 0.0}]
engine, *_ = deepspeed.initialize(model=model, model_parameters=groups, config=ds)
opt = engine.optimizer
if partial:
    opt.subgroup_to_device[0] = "cuda"
delayed = mode == "delayed" and deepspeed_offload.delay_offload_updates(engine, 1, print)
if stage == 3:  # the weights as the forward fetches them: each rank's 16-bit partitions, and the persistent ones
    flats, masters = opt.fp16_partitioned_groups_flat, opt.fp32_partitioned_groups_flat
    weights = lambda: [f.detach().clone() for f in flats]
    def set_weights(values):
        for f, w in zip(flats, values):
            f.data.copy_(w)
        opt.persistent_parameters[0].partition(opt.persistent_parameters)  # gathered again only once released
        opt.persistent_parameters[0].all_gather(opt.persistent_parameters)
    assert opt.persistent_parameters and len(flats) > 2
else:
    masters = opt.single_partition_of_fp32_groups
    weights = lambda: [p.detach().clone() for p in engine.module.parameters()]
    def set_weights(values):
        for p, w in zip(engine.module.parameters(), values):
            p.data.copy_(w)
late = weights()
torch.manual_seed(1 + int(sys.argv[5]))  # each rank its own data
batches = [torch.randn(2, 16).to(torch.bfloat16) for _ in range(12)]
losses, norms = [], []
for step in range(6):
    if mode == "reference":  # the weights of one step earlier
        current = weights()
        set_weights(late)
        late = current
    step_loss = 0.0
    for x in batches[2 * step:2 * step + 2]:
        loss = engine(x).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
        step_loss += loss.item()
    losses.append(step_loss)
    norms.append(float(engine.get_global_grad_norm()))
in_flight = getattr(engine.optimizer, "dslm_delayed_update", None)
pending_before_settle = bool(in_flight and in_flight.pending)
deepspeed_offload.settle(engine)
master = [t.detach().flatten().tolist() for t in masters]
state = opt.optimizer.state[masters[-1]]  # an offloaded partition's Adam state
with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), enabled=stage == 3):
    model_weights = [p.detach().float().flatten().tolist() for p in engine.module.parameters()]
print("RESULT " + json.dumps({"delayed": delayed, "losses": losses, "norms": norms, "master": master,
                              "weights": [w.float().flatten().tolist() for w in weights()], "model": model_weights,
                              "pending_before_settle": pending_before_settle, "lr": engine.get_lr()[0],
                              "adam_step": int(state["step"]),
                              "exp_avg_sq": state["exp_avg_sq"].flatten()[:64].tolist()}))
"""


def _run(mode: str, stage: int, accumulation: str, offload: str = "full") -> list[dict]:
    """Two ranks (gloo): each rank's result."""
    port = str(rendezvous_port())
    ranks = [preloaded.Popen([sys.executable, "-c", SCRIPT, mode, port, str(SRC), str(stage), str(rank), accumulation,
                              offload],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    results = []
    for rank in ranks:
        stdout, stderr = rank.communicate(timeout=400)
        line = next((x for x in stdout.splitlines() if x.startswith("RESULT ")), None)
        assert line, stdout[-2000:] + stderr[-4000:]
        results.append(json.loads(line[len("RESULT "):]))
    return results


@pytest.mark.parametrize("stage, accumulation", [(1, "fp32"), (2, "fp32"), (2, "bf16"), (3, "bf16")])
def test_delayed_update_equals_deepspeed_with_gradients_one_step_late(stage, accumulation):
    """Two ranks, each with its own data and its half of the master weights and Adam state. fp32: the presets'
    accumulation on the GPU; bf16: DeepSpeed's default (the seeds' config), each micro-batch's gradients added in host
    memory, which the update in flight does not read. ZeRO-3 keeps its accumulation in host memory and fetches the
    weights from the 16-bit partitions there, which the delayed update rewrites at the next step."""
    delayed, reference = _run("delayed", stage, accumulation), _run("reference", stage, accumulation)
    for mine, theirs in zip(delayed, reference):
        assert mine["delayed"] is True
        assert mine["pending_before_settle"], "the last step's update should still be in flight before settle()"
        # Every step's loss, gradient norm and the final weights, master weights and Adam state: bitwise equal.
        assert mine["losses"] == theirs["losses"]
        assert mine["norms"] == theirs["norms"]
        assert mine["master"] == theirs["master"]
        assert mine["weights"] == theirs["weights"]
        assert mine["exp_avg_sq"] == theirs["exp_avg_sq"]
        assert mine["adam_step"] == 6 and mine["lr"] == theirs["lr"]
        # The delay changes the trajectory: the first two steps run at the initial weights, later ones one step late.
        assert mine["losses"][0] != mine["losses"][1]  # different batches, same weights
        assert len(set(mine["losses"])) == 6
    # Each rank updated its own half and received the other's: the same model on both.
    assert delayed[0]["master"] != delayed[1]["master"]
    assert delayed[0]["model"] == delayed[1]["model"]
    assert delayed[0]["losses"] != delayed[1]["losses"]


def test_a_partial_zero3_offload_delays_its_gpu_part_alike():
    """ZeRO-3 with half of the optimizer offloaded: the sub-group DeepSpeed updates on the GPU (labelled so on this CPU
    machine) takes DeepSpeed's own AdamW at the step, and its 16-bit partition waits for the next step like the
    offloaded ones', so every weight is one step late alike. The reference steps the offloaded part with
    DeepSpeedCPUAdam, so the two agree to its rounding, not bitwise; a sub-group updated a step early or late would
    part them by about the learning rate (1e-2)."""
    delayed, reference = _run("delayed", 3, "bf16", "partial"), _run("reference", 3, "bf16", "partial")
    for mine, theirs in zip(delayed, reference):
        assert mine["delayed"] is True and mine["pending_before_settle"]
        assert mine["losses"] == pytest.approx(theirs["losses"], rel=1e-4, abs=1e-6)
        assert mine["norms"] == pytest.approx(theirs["norms"], rel=1e-4, abs=1e-6)
        for got, want in zip(mine["master"], theirs["master"]):
            assert got == pytest.approx(want, abs=1e-4)
        assert len(set(mine["losses"])) == 6


# One rank per GPU: the delayed update with and without the prefetch of its 16-bit weights to a second GPU buffer
# (--delayed_update_prefetch, a CUDA stream's copy: GPUs, which CI does not have, run it; benchmarks/run_device.sh's
# gpu-tests plan runs it on the device). ~100M parameters, so that the copies take a while; with two ranks each
# prefetches its half and the boundary all-gathers the halves.
PREFETCH_ON_GPU = r"""
import json, os, sys, torch
rank, world = sys.argv[4], sys.argv[5]
os.environ.update(RANK=rank, WORLD_SIZE=world, LOCAL_RANK=rank, MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
sys.path.insert(0, sys.argv[2])
torch.cuda.set_device(int(rank))
import deepspeed
from model_utils.patches import deepspeed_offload
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(24)]).cuda()
ds = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "gradient_clipping": 0.05,
      "bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"},
      "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1}},
      "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}}}
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds)
assert deepspeed_offload.delay_offload_updates(engine, 1, print, prefetch=sys.argv[3] == "on")
initial = [float(p.detach().float().pow(2).sum()) for p in engine.module.parameters()]
torch.manual_seed(1 + int(rank))  # each rank its own data
batches = [torch.randn(4, 2048, device="cuda", dtype=torch.bfloat16) for _ in range(16)]
losses = []
for step in range(8):
    for x in batches[2 * step:2 * step + 2]:
        loss = engine(x).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
    losses.append(loss.item())
deepspeed_offload.settle(engine)
print("RESULT " + json.dumps({
    "prefetched": engine.optimizer.dslm_delayed_update.staged is not None, "losses": losses, "initial": initial,
    "weights": [float(p.detach().float().pow(2).sum()) for p in engine.module.parameters()],
    "first": engine.module[0].weight.detach().float().flatten()[:4096].tolist()}))
"""


@pytest.mark.parametrize("world", [1, 2])
def test_the_prefetch_to_the_gpu_changes_no_weight(world):
    """The boundary takes each update's weights from the GPU buffer the thread filled on its own stream, not over
    PCIe: every loss and weight bitwise as without it (a fill that overtook the boundary's read, or a read before
    the fill ended, would give the next step other weights); with two ranks, both hold the same model."""
    if gpu_count() < world:
        pytest.skip(f"needs {world} GPU(s): the prefetch is a CUDA stream's copy (PLAN=gpu-tests on the device)")
    runs = {}
    for prefetch in ("on", "off"):
        port = str(rendezvous_port())
        ranks = [subprocess.Popen([sys.executable, "-c", PREFETCH_ON_GPU, port, str(SRC), prefetch, str(rank),
                                   str(world)], env=gpu_environment(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True)
                 for rank in range(world)]
        runs[prefetch] = []
        for process in ranks:
            stdout, stderr = process.communicate(timeout=600)
            line = next((x for x in stdout.splitlines() if x.startswith("RESULT ")), None)
            assert line, stdout[-2000:] + stderr[-4000:]
            runs[prefetch].append(json.loads(line[len("RESULT "):]))
    for on, off in zip(runs["on"], runs["off"]):
        assert on["prefetched"] and not off["prefetched"]
        assert all(a != b for a, b in zip(on["weights"], on["initial"]))  # the updates landed
        for key in ("losses", "weights", "first"):
            assert on[key] == off[key], key
    assert all(run["weights"] == runs["on"][0]["weights"] for run in runs["on"])  # one model on every rank


# One rank whose last step leaves its update (about a second for these 100M parameters on a CPU) in flight when the
# script ends, as a benchmark's last step or an error raised mid-run does.
EXIT_IN_FLIGHT = r"""
import os, sys, torch
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
sys.path.insert(0, sys.argv[2])
import deepspeed
from model_utils.patches import deepspeed_offload
model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(24)])
ds = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "bf16": {"enabled": True},
      "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
      "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}}
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds)
assert deepspeed_offload.delay_offload_updates(engine, 1, print)
for _ in range(4):
    engine.backward(engine(torch.randn(2, 2048).to(torch.bfloat16)).float().pow(2).mean())
    engine.step()
print("IN FLIGHT", engine.optimizer.dslm_delayed_update.thread.is_alive(), flush=True)
"""


def test_a_process_ending_with_an_update_in_flight_exits_cleanly():
    """The update thread is no daemon: a process that ends while it runs waits for it. A daemon thread inside
    torch's AdamW kernel when the interpreter finalises aborts the process (SIGABRT, 'terminate called without an
    active exception'): a benchmark run of Qwen3-4B under ZeRO-3 ended so, and so would a run stopped by an error."""
    done = preloaded.run([sys.executable, "-c", EXIT_IN_FLIGHT, str(rendezvous_port()), str(SRC)], capture_output=True,
                         text=True, timeout=300)
    assert "IN FLIGHT True" in done.stdout, done.stdout[-2000:] + done.stderr[-2000:]
    assert done.returncode == 0 and "terminate called" not in done.stderr, done.stderr[-2000:]


DELAYED_ARGS = [*FAST_ARGS, "--max_steps", "8", "--checkpoint_freq", "4", "--no-export", "--seed", "5",
                "--gradient_accumulation_steps", "2"]


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("preset", ["zero2-offload", "zero3-offload"])
def test_a_delayed_update_run_resumes_exactly(session_cache, tmp_path, preset):
    """The trainer on 2 ranks with --delayed_update_from_step 3: killed (-9) after its step-4 checkpoint and resumed,
    it logs the uninterrupted run's losses from step 5 on (a checkpoint settles the update in flight, and the
    uninterrupted run settles it at the same step). Without the delay the losses part at step 4, the first whose
    gradients are taken at the weights of one step earlier (before step 3's update). ZeRO-2 with the optimizer
    offloaded, and ZeRO-3 with the parameters offloaded too."""
    config = ["--ds_config", f"configs/{preset}.json"]
    delayed = [*DELAYED_ARGS, *config, "--delayed_update_from_step", "3"]
    whole = run_trainer(tmp_path / "whole", delayed)
    assert_ok(whole)
    assert "each step's CPU optimizer update runs beside the next step's forward and backward" in whole.output
    resumed = kill_after_checkpoint_then_resume(tmp_path / "killed", delayed, 4)
    manifest = json.loads((tmp_path / "killed" / "step-00000004" / "manifest.json").read_text())
    assert manifest["levers_in_force"]["delayed_update_from_step"] == 3
    assert "differ from the checkpoint's" not in resumed.output
    plain = run_trainer(tmp_path / "plain", [*DELAYED_ARGS, *config])
    assert_ok(plain)
    want, got, undelayed = whole.losses_by_step(), resumed.losses_by_step(), plain.losses_by_step()
    assert [got[s] for s in range(5, 9)] == [want[s] for s in range(5, 9)], (want, got)
    assert [undelayed[s] for s in (1, 2, 3)] == [want[s] for s in (1, 2, 3)] and undelayed[4] != want[4], (want,
                                                                                                          undelayed)
