"""Every key of every shipped DeepSpeed config reaches the run: the trainer's own setup() builds the engine from each
preset (one CPU process, gloo), and each key's value is read back from what it changes in the engine, optimizer or
LR scheduler. A key with no entry in EFFECTS fails the test: a preset must not carry settings that do nothing (as a
DeepSpeed `activation_checkpointing` section does when nothing calls DeepSpeed's checkpointing API).

Some keys change only GPU behaviour (16-bit precision, ZeRO-3's communication stream): on CPU their entry reads the
value DeepSpeed parsed into its engine configuration, and benchmarks/journey.sh runs each preset on a GPU.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import preloaded
from conftest import REPO, SRC

PRESETS = ["ds_config.json", *sorted(f"configs/{p.name}" for p in (REPO / "configs").glob("*.json"))]
TESTS = os.path.dirname(os.path.abspath(__file__))


def _zero(engine):
    return engine.optimizer


def _offload(engine, what):
    opt = engine.optimizer
    if engine.zero_optimization_stage() == 3:
        return {"optimizer": opt.offload_optimizer, "param": opt.offload_param}[what]
    return opt.cpu_offload if what == "optimizer" else False


def _pinned(engine, what):
    opt = engine.optimizer
    if what == "param":
        return opt.parameter_offload.offload_param_pin_memory
    return opt.offload_optimizer_pin_memory if engine.zero_optimization_stage() == 3 else opt.cpu_offload_pin_memory


def _inner(engine):
    return engine.optimizer.optimizer  # the torch (or DeepSpeed CPU Adam) optimizer ZeRO wraps


def _optimizer_type(engine):
    import torch
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    inner = _inner(engine)
    if isinstance(inner, torch.optim.AdamW) or (isinstance(inner, DeepSpeedCPUAdam) and inner.adam_w_mode):
        return "AdamW"
    return type(inner).__name__


def _stage(engine):
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    opt = engine.optimizer
    if isinstance(opt, DeepSpeedZeroOptimizer_Stage3):
        return 3
    assert isinstance(opt, DeepSpeedZeroOptimizer)
    return 2 if opt.partition_gradients else 1


def _offload_device(engine, what):
    return "cpu" if _offload(engine, what) else "none"


# key path -> what the engine holds for it
EFFECTS = {
    "train_micro_batch_size_per_gpu": lambda e: e.train_micro_batch_size_per_gpu(),
    "gradient_accumulation_steps": lambda e: e.gradient_accumulation_steps(),
    "train_batch_size": lambda e: e.train_batch_size(),
    "gradient_clipping": lambda e: e.gradient_clipping(),
    "steps_per_print": lambda e: e.steps_per_print(),
    "wall_clock_breakdown": lambda e: e.wall_clock_breakdown(),
    "bf16.enabled": lambda e: e.bfloat16_enabled(),
    "bf16.check_grad_overflow": lambda e: e._config.bfloat16_config.check_grad_overflow,  # GPU: bf16 overflow skip
    "fp16.enabled": lambda e: e.fp16_enabled(),
    # GPU: the fp16 loss scaler's settings (journey's fp16 run logs the scale)
    "fp16.loss_scale": lambda e: e._config.float16_config.loss_scale,
    "fp16.initial_scale_power": lambda e: e._config.float16_config.initial_scale_power,
    "fp16.loss_scale_window": lambda e: e._config.float16_config.loss_scale_window,
    "fp16.hysteresis": lambda e: e._config.float16_config.hysteresis,
    "fp16.min_loss_scale": lambda e: e._config.float16_config.min_loss_scale,
    "optimizer.type": _optimizer_type,
    "optimizer.params.lr": lambda e: e.lr_scheduler.org_lrs[0],  # the schedule's peak
    "optimizer.params.betas": lambda e: list(_inner(e).param_groups[0]["betas"]),
    "optimizer.params.eps": lambda e: _inner(e).param_groups[0]["eps"],
    "optimizer.params.weight_decay": lambda e: _inner(e).param_groups[0]["weight_decay"],  # matrices' group
    "optimizer.params.torch_adam": lambda e: type(_inner(e)).__module__.startswith("torch."),
    "optimizer.params.fused": lambda e: all(g.get("fused") for g in _inner(e).param_groups),
    "scheduler.type": lambda e: type(e.lr_scheduler).__name__,
    "scheduler.params.total_num_steps": lambda e: e.lr_scheduler.total_num_steps,
    "scheduler.params.warmup_num_steps": lambda e: e.lr_scheduler.warmup_num_steps,
    "scheduler.params.warmup_min_ratio": lambda e: e.lr_scheduler.warmup_min_ratio,
    "scheduler.params.cos_min_ratio": lambda e: e.lr_scheduler.cos_min_ratio,
    "scheduler.params.warmup_type": lambda e: e.lr_scheduler.warmup_type,
    # ZeRO-1/2's gradient accumulation buffer (in bf16 training an fp32 partition on the GPU; fp32 training is fp32)
    "data_types.grad_accum_dtype": lambda e: {"torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16"}[
        str(e.optimizer.gradient_accumulation_dtype)],
    "zero_optimization.stage": _stage,
    "zero_optimization.overlap_comm": lambda e: (e.optimizer.overlap_comm if _stage(e) < 3
                                                 else e.zero_overlap_comm()),  # ZeRO-3: a CUDA stream
    "zero_optimization.contiguous_gradients": lambda e: e.optimizer.contiguous_gradients,
    "zero_optimization.reduce_scatter": lambda e: e.optimizer.reduce_scatter,
    "zero_optimization.allgather_bucket_size": lambda e: e.optimizer.allgather_bucket_size,
    "zero_optimization.reduce_bucket_size": lambda e: e.optimizer.reduce_bucket_size,
    "zero_optimization.offload_optimizer.device": lambda e: _offload_device(e, "optimizer"),
    "zero_optimization.offload_optimizer.pin_memory": lambda e: _pinned(e, "optimizer"),
    "zero_optimization.offload_param.device": lambda e: _offload_device(e, "param"),
    "zero_optimization.offload_param.pin_memory": lambda e: _pinned(e, "param"),
    "zero_optimization.stage3_prefetch_bucket_size": lambda e: e.optimizer.parameter_offload._prefetch_bucket_sz,
    "zero_optimization.stage3_param_persistence_threshold":
        lambda e: e.optimizer.parameter_offload.param_numel_persistence_threshold,
    "zero_optimization.stage3_max_live_parameters":
        lambda e: e.optimizer.parameter_offload._max_available_parameters_in_numel,
    "zero_optimization.stage3_max_reuse_distance":
        lambda e: e.optimizer.parameter_offload._max_reuse_distance_in_numel,
    "zero_optimization.offload_optimizer.ratio": lambda e: e.optimizer.partial_offload,
    "zero_optimization.sub_group_size": lambda e: e.optimizer.sub_group_size,
}


def leaves(node, prefix=""):
    for key, value in node.items():
        if key.startswith("_"):
            continue  # comments
        path = f"{prefix}.{key}" if prefix else key
        if isinstance(value, dict):
            yield from leaves(value, path)
        else:
            yield path, value


def report(preset: str, out: str):
    """Run in a fresh process: the trainer's setup() on one CPU rank, then each key's effective value as JSON."""
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    from model_utils.config.flags import parse_args
    from model_utils.planning.preflight import checked_plan
    from model_utils.runtime.distributed import free_port, setup_distributed
    from model_utils.train.build import build_run, start_log

    os.environ["MASTER_PORT"] = str(free_port())
    cfg = parse_args(["--ds_config", preset, "--dummy_data", "32", "--seq_len", "32", "--max_steps", "100",
                      "--checkpoint_dir", os.path.join(os.path.dirname(out), "ckpt"), "--no-tensorboard"])
    dist = setup_distributed()
    log = start_log(cfg, dist)
    run = build_run(checked_plan(cfg, dist, log), dist, log)
    effective = {}
    for path, _ in leaves(run.ds_config):
        effective[path] = EFFECTS[path](run.engine) if path in EFFECTS else "NO EFFECT KNOWN"
    with open(out, "w") as f:
        json.dump({"resolved": dict(leaves(run.ds_config)), "effective": effective}, f, default=str)


def partial_offload_checkpoint(preset: str, out: str):
    """One ZeRO-3 step with a partial optimizer offload, and which sub-groups' Adam state DeepSpeed's state_dict holds.
    Stand-in: the CPU accelerator names every sub-group's device "cpu", so sub-group 0 is labelled "cuda" (no GPU here)
    to take DeepSpeed's GPU path: its backup torch AdamW, on this machine's tensors."""
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    from model_utils.config.flags import parse_args
    from model_utils.planning.preflight import checked_plan
    from model_utils.runtime.distributed import free_port, setup_distributed
    from model_utils.train.build import build_run, start_log
    from model_utils.train.step import train_step

    os.environ["MASTER_PORT"] = str(free_port())
    cfg = parse_args(["--ds_config", preset, "--dummy_data", "32", "--seq_len", "32", "--max_steps", "100",
                      "--checkpoint_dir", os.path.join(os.path.dirname(out), "ckpt"), "--no-tensorboard"])
    from model_utils.config.deepspeed import zero3_sub_groups
    from model_utils.planning.plan import make_plan

    dist = setup_distributed()
    log = start_log(cfg, dist)
    run = build_run(checked_plan(cfg, dist, log), dist, log)
    zero3 = run.engine.optimizer
    plan = make_plan(cfg, 1, decides=False)
    planned = zero3_sub_groups([list(g) for g in plan.model.param_groups], 1, run.ds_config["zero_optimization"]["sub_group_size"])
    zero3.subgroup_to_device[0] = "cuda"
    train_step(run)
    state = zero3.state_dict()
    with open(out, "w") as f:
        json.dump({"ratio": zero3.partial_offload, "engine_groups": list(zero3.fp16_partitioned_groups_flat_numel),
                   "plan_groups": planned, "saved": len(state["optimizer_state_dict"]["state"]),
                   "gpu_part_state": len(zero3.backup_optimizer.state),
                   "gpu_part_saved": sorted(state.get("dslm_partial_offload_gpu_state", {}))}, f)


def partial_offload_losses(spec: str, out: str):
    """`spec` is "CONFIG STOP_AT SAVE_AT": a 6-step run of a partial offload (sub-group 0 on the stand-in GPU, as
    above) from the checkpoint directory's latest checkpoint or from scratch, stopped after step STOP_AT, saving at
    SAVE_AT (0: never); the losses as JSON."""
    preset, stop_at, save_at = spec.split()
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    from model_utils.config.flags import parse_args
    from model_utils.planning.preflight import checked_plan
    from model_utils.runtime.distributed import free_port, setup_distributed
    from model_utils.train.build import build_run, start_log
    from model_utils.train.loop import save
    from model_utils.train.step import train_step

    os.environ["MASTER_PORT"] = str(free_port())
    cfg = parse_args(["--ds_config", preset, "--dummy_data", "32", "--seq_len", "32", "--max_steps", "6",
                      "--checkpoint_dir", os.path.join(os.path.dirname(preset), "ckpt"), "--no-tensorboard",
                      "--no-background_checkpoint"])
    dist = setup_distributed()
    log = start_log(cfg, dist)
    run = build_run(checked_plan(cfg, dist, log), dist, log)
    run.engine.optimizer.subgroup_to_device[0] = "cuda"
    losses = {}
    while run.step < int(stop_at):
        result = train_step(run)
        losses[run.step] = result.loss_sum.item()
        if run.step == int(save_at):
            save(run, wait=True)
    with open(out, "w") as f:
        json.dump(losses, f)


def run_report(preset: str, tmp_path, what: str = "report") -> dict:
    out = tmp_path / "effective.json"
    code = f"import sys; sys.path[:0] = [{TESTS!r}, {os.path.dirname(TESTS)!r}, {str(SRC)!r}]; import test_presets; " \
           f"test_presets.{what}({preset!r}, {str(out)!r})"
    proc = preloaded.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("preset", PRESETS)
def test_every_key_of_the_preset_changes_the_engine(preset, session_cache, tmp_path):
    data = run_report(preset, tmp_path)
    raw = json.loads((REPO / preset).read_text())
    unknown = [path for path, _ in leaves(raw) if path not in EFFECTS]
    assert not unknown, f"{preset}: no known effect of {unknown}: check what they change and add it to EFFECTS, " \
                        "or remove them from the preset"
    for path, _ in leaves(raw):
        want, got = data["resolved"][path], data["effective"][path]
        assert got == want, f"{preset}: {path} is {want} in the resolved config but {got} in the engine"


def test_a_partial_offload_splits_the_optimizer_where_the_memory_estimate_expects(session_cache, tmp_path):
    """`offload_optimizer.ratio` under ZeRO-3 (what the preflight proposes when offloaded states do not fit the node):
    DeepSpeed takes the ratio and cuts the optimizer into the sub-groups the plan's estimate counts (the first
    floor((1 - ratio) n) stay on the GPU, the rest go to the host). The GPU is a stand-in (partial_offload_checkpoint)."""
    config = json.loads((REPO / "configs" / "zero3-offload.json").read_text())
    config["zero_optimization"]["offload_optimizer"]["ratio"] = 0.5
    config["zero_optimization"]["sub_group_size"] = 20_000  # several sub-groups of the tiny model
    path = tmp_path / "partial.json"
    path.write_text(json.dumps(config))
    data = run_report(str(path), tmp_path, "partial_offload_checkpoint")
    assert data["ratio"] == 0.5
    assert len(data["engine_groups"]) >= 4 and data["engine_groups"] == data["plan_groups"], data
    # What a checkpoint of it holds: DeepSpeed's ZeRO-3 state_dict keeps its CPU Adam's state, not the state of the AdamW
    # that updates the sub-groups on the GPU, so a resume restarts their moments (ds_config's note says so). Should a
    # DeepSpeed release save them, this fails: drop the note.
    assert data["gpu_part_state"] == 1 and data["saved"] == len(data["engine_groups"]) - 1, data
    assert data["gpu_part_saved"] == [0], data  # patches.deepspeed_zero3 adds it


def test_a_partial_offload_resumes_exactly(session_cache, tmp_path):
    """A partial offload's run resumed from its step-3 checkpoint continues with the losses of the uninterrupted run:
    the GPU part's AdamW state (sub-group 0, on the stand-in GPU of partial_offload_checkpoint) is saved and restored
    by patches.deepspeed_zero3. Without the patch, DeepSpeed's checkpoint lacks that state and step 4 differs."""
    config = json.loads((REPO / "configs" / "zero3-offload.json").read_text())
    config["zero_optimization"]["offload_optimizer"]["ratio"] = 0.5
    config["zero_optimization"]["sub_group_size"] = 20_000

    def losses(name, stop_at, save_at):
        folder = tmp_path / name
        folder.mkdir(exist_ok=True)
        (folder / "partial.json").write_text(json.dumps(config))
        return run_report(f"{folder / 'partial.json'} {stop_at} {save_at}", folder, "partial_offload_losses")

    whole = losses("whole", 6, 0)
    assert losses("resumed", 3, 3).keys() == {"1", "2", "3"}
    resumed = losses("resumed", 6, 0)
    assert resumed.keys() == {"4", "5", "6"}
    assert [resumed[k] for k in ("4", "5", "6")] == [whole[k] for k in ("4", "5", "6")], (whole, resumed)
