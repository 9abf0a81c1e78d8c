"""DeepSpeed's ZeRO-1/2 step (DeepSpeedZeroOptimizer), made to stop waiting on the host.

In bf16 with `check_grad_overflow` DeepSpeed scans every gradient tensor for inf/NaN (amax, amin, isfinite...: about
seven kernel launches per tensor, host time per step that grows with the tensors while the GPU idles), then
checks on the host that the all-reduced global norm is finite, which makes the host wait for the whole backward pass
before it can queue the update. A non-finite gradient makes that norm non-finite on every rank, so:

- NORM_OVERFLOW_CHECK: the per-tensor scan is skipped; the norm's host check alone skips the same steps.
- DEVICE_OVERFLOW_SKIP: the norm's verdict goes to torch's fused AdamW as `found_inf` (which then leaves parameters,
  moments and step count untouched) instead of to the host; the loop reads it with its per-step flags and books the
  step as DeepSpeed books one it skips on the host (`settle_device_skip`).
"""

from __future__ import annotations

import functools

from model_utils.patches import Patch, gate

NORM_OVERFLOW_CHECK = Patch(
    "deepspeed", "0.19.6", "0.19.8",
    "DeepSpeedZeroOptimizer.check_overflow: replaced by a no-op on the optimizer instance",
    "the per-tensor scan idles the GPU every step; without it the step is faster (docs/PERFORMANCE.md, Speed options: "
    "In force by default)",
    ("tests/distributed/test_zero_step_patch.py::test_patched_zero_step_skips_and_clips_like_deepspeed",
     "tests/unit/patches/test_patches.py::test_an_untested_deepspeed_takes_its_own_zero_step"))
DEVICE_OVERFLOW_SKIP = Patch(
    "deepspeed", "0.19.6", "0.19.8",
    "DeepSpeedZeroOptimizer.scaled_global_norm (wrapped on the instance), stage_1_and_2.is_invalid_grad_norm "
    "(process-wide: 'valid' for a norm whose verdict the GPU acts on), and the engine's skipped_steps, _step_applied, "
    "_global_grad_norm and LR scheduler step when the GPU skipped an update",
    "the host no longer waits for the backward pass before queuing the update (docs/PERFORMANCE.md, Speed options: "
    "In force by default)",
    ("tests/distributed/test_zero_step_patch.py::test_patched_zero_step_skips_and_clips_like_deepspeed",
     "tests/distributed/test_zero_step_patch.py::test_gpu_skipped_step_is_skipped_on_every_rank"))

_CHECKED_ON_DEVICE = "_dslm_checked_on_device"  # marks a norm tensor whose validity the GPU itself acts on


def streamline_zero_step(engine, overflow_check: str, log) -> str:
    """Apply `overflow_check` (auto, device, norm, scan) to a ZeRO-1/2 engine; return the mode in force ('scan' is
    DeepSpeed's own step, untouched)."""
    try:
        from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    except ImportError:
        return "scan"
    opt = getattr(engine, "optimizer", None)
    if (overflow_check == "scan" or not isinstance(opt, DeepSpeedZeroOptimizer)
            or not gate(NORM_OVERFLOW_CHECK, log) or not _norm_overflow_check(opt, log)):
        return "scan"
    if overflow_check in ("auto", "device") and _device_overflow_skip(engine, log):
        return "device"
    return "norm"


def _norm_overflow_check(opt, log) -> bool:
    """Let the global gradient norm, not a per-tensor scan, find non-finite gradients."""
    applicable = (getattr(opt, "check_grad_overflow", False) and getattr(opt, "compute_grad_norm", False)
                  and not getattr(opt, "cpu_offload", True) and callable(getattr(opt, "check_overflow", None)))
    if not applicable:
        return False
    # DeepSpeedZeroOptimizer.step sets overflow = False, calls check_overflow, then marks the step overflowed when the
    # (all-reduced) norm is inf/NaN; a no-op check leaves that second test as the only one.
    opt.check_overflow = lambda partition_gradients=True: None
    log("zero: non-finite gradients found through the global gradient norm (per-tensor overflow scan skipped)")
    return True


def _device_overflow_skip(engine, log) -> bool:
    """The verdict on the global norm goes to the fused AdamW as `found_inf` instead of to the host. DeepSpeed's step
    then runs on as if the norm were valid: its clipping scales the (non-finite) gradients by 1/inf, the optimizer
    leaves everything untouched, and the bf16 copy rewrites unchanged weights."""
    import torch
    from deepspeed.runtime.zero import stage_1_and_2

    opt = engine.optimizer
    inner, scheduler = getattr(opt, "optimizer", None), getattr(engine, "lr_scheduler", None)
    applicable = (isinstance(inner, (torch.optim.Adam, torch.optim.AdamW))
                  and all(group.get("fused") for group in inner.param_groups)
                  and getattr(opt, "dtype", None) == torch.bfloat16 and not getattr(opt, "torch_autocast_gradscaler", None)
                  and callable(getattr(stage_1_and_2, "is_invalid_grad_norm", None))
                  and (scheduler is None or hasattr(scheduler, "last_batch_iteration")))
    if not applicable:
        log("zero: the step's overflow verdict stays on the host (--overflow_check device needs torch's fused AdamW, "
            "bf16 and a DeepSpeed LR scheduler)")
        return False
    _host_skips_norms_checked_on_device()
    original = opt.scaled_global_norm

    def scaled_global_norm(norm_type=2):
        norm = original(norm_type)
        invalid = ~torch.isfinite(norm) | (norm < 0)  # as is_invalid_grad_norm (-1 is DeepSpeed's inf/NaN mark)
        inner.found_inf = invalid.float()  # read by torch's fused Adam(W) kernel: skip the whole update when 1
        opt.dslm_step_skipped = invalid
        setattr(norm, _CHECKED_ON_DEVICE, True)
        return norm

    opt.scaled_global_norm = scaled_global_norm
    log("zero: a step with non-finite gradients is skipped by the GPU (fused AdamW found_inf); the host learns of it "
        "at the loop's per-step flags")
    return True


@functools.cache
def _host_skips_norms_checked_on_device() -> None:
    """stage_1_and_2 asks is_invalid_grad_norm (a host synchronisation) in step() and again in its clipping; for a
    norm whose verdict already went to the optimizer the answer is 'valid' (the invalid case is handled on device)."""
    from deepspeed.runtime.zero import stage_1_and_2

    original = stage_1_and_2.is_invalid_grad_norm

    def is_invalid_grad_norm(norm):
        return False if getattr(norm, _CHECKED_ON_DEVICE, False) else original(norm)

    stage_1_and_2.is_invalid_grad_norm = is_invalid_grad_norm


def device_skip_flag(engine, device):
    """1.0 (a device tensor, not yet read) when the GPU skipped the last update (--overflow_check device), else 0."""
    import torch

    flag = getattr(engine.optimizer, "dslm_step_skipped", None)
    return flag.float() if flag is not None else torch.zeros((), device=device)


def settle_device_skip(engine) -> None:
    """Book an update the GPU skipped as DeepSpeed books one it skips on the host: a skipped step, not applied, the
    norm reported as inf, and the LR scheduler's step (taken as if the update had been applied) taken back."""
    engine.skipped_steps += 1
    engine._step_applied = False
    engine._global_grad_norm = engine.optimizer._global_grad_norm = float("inf")
    if engine.lr_scheduler is not None:
        engine.lr_scheduler.step(engine.lr_scheduler.last_batch_iteration - 1)
