"""DeepSpeed's ZeRO-3 optimizer (DeepSpeedZeroOptimizer_Stage3) with its optimizer offloaded: a partial offload made to
checkpoint all of its optimizer state, and the gradients accumulated on the GPU.

With `"offload_optimizer": {"ratio": r}` (r < 1) DeepSpeed updates the first sub-groups of the optimizer partition on
the GPU with a torch AdamW of its own (`backup_optimizer`) and the rest on the host with its CPU Adam. Its
`state_dict` holds the CPU Adam's state only: a resume would restart the GPU part's Adam moments and step counts.

- PARTIAL_OFFLOAD_STATE: the GPU part's AdamW state is added to the optimizer's checkpoint (one entry per sub-group it
  updates) and put back when the checkpoint is loaded.
- GRADIENT_BUFFER_ON_GPU: with the optimizer offloaded, the gradient accumulation buffer lives on the GPU instead of
  in pinned host memory (--offload_grad_buffer).
"""

from __future__ import annotations

from . import Patch, gate

PARTIAL_OFFLOAD_STATE = Patch(
    "deepspeed", "0.19.8", "0.19.8",
    "DeepSpeedZeroOptimizer_Stage3._rigid_state_dict and _rigid_load_state_dict (wrapped on the optimizer instance): "
    "the backup AdamW's per-sub-group state saved and restored beside the CPU Adam's",
    "correctness, not speed: without it a partial offload's resume restarts the Adam moments of the part on the GPU "
    "(its losses then part from the uninterrupted run's at the first step after the resume)",
    ("tests/distributed/test_presets.py::test_a_partial_offload_splits_the_optimizer_where_the_memory_estimate_expects",
     "tests/distributed/test_presets.py::test_a_partial_offload_resumes_exactly"))

# The key of the GPU part's state in the optimizer's checkpoint: {sub-group index: that sub-group's AdamW state}.
GPU_PART_STATE = "dslm_partial_offload_gpu_state"


def keep_partial_offload_state(optimizer, log) -> bool:
    """Wrap a ZeRO-3 optimizer with a partial offload so that its checkpoints hold the GPU part's AdamW state.
    Returns whether it applies (False: no partial offload, or an untested DeepSpeed, which the log names)."""
    backup = getattr(optimizer, "backup_optimizer", None)
    if backup is None or not hasattr(optimizer, "_rigid_state_dict") or not gate(PARTIAL_OFFLOAD_STATE, log):
        return False
    flat = optimizer.fp32_partitioned_groups_flat
    save, load = optimizer._rigid_state_dict, optimizer._rigid_load_state_dict

    def state_dict():
        state = save()
        state[GPU_PART_STATE] = {i: dict(backup.state[p]) for i, p in enumerate(flat) if p in backup.state}
        return state

    def load_state_dict(state, load_optimizer_states=True):
        load(state, load_optimizer_states)
        if load_optimizer_states:
            for i, saved in state.get(GPU_PART_STATE, {}).items():
                param = flat[int(i)]
                backup.state[param] = {k: (v.to(param.device) if hasattr(v, "to") and k != "step" else v)
                                       for k, v in saved.items()}

    optimizer._rigid_state_dict, optimizer._rigid_load_state_dict = state_dict, load_state_dict
    log("checkpoints: a partial optimizer offload's GPU part (its AdamW state) is saved with the rest "
        "(patches.deepspeed_zero3)")
    return True


GRADIENT_BUFFER_ON_GPU = Patch(
    "deepspeed", "0.19.8", "0.19.8",
    "DeepSpeedZeroOptimizer_Stage3.grad_partitions_flat_buffer, its per-parameter views "
    "(_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition) and inf_or_nan_tracker: allocated on the GPU when "
    "the optimizer is offloaded, as DeepSpeed's own reload_states places them",
    "speed: with the optimizer offloaded DeepSpeed keeps the gradient accumulation buffer in pinned host memory, so "
    "every micro-batch copies each gradient partition to the host and, after the first, the buffer back to the GPU to "
    "add to it (DeepSpeed issue 4113); on the GPU the buffer crosses PCIe once per optimizer step "
    "(docs/PERFORMANCE.md, Big models with CPU offload)",
    ("tests/distributed/test_offload_grad_buffer.py::test_gradients_accumulated_on_the_gpu_train_as_deepspeeds_host_buffer",))


def place_gradient_buffer_on_gpu(optimizer, log) -> bool:
    """Move a ZeRO-3 optimizer's gradient accumulation buffer from host memory to the GPU when the optimizer is
    offloaded to the CPU (not NVMe). DeepSpeed's partition_grads then adds each micro-batch's gradient partition to it
    on the GPU and copies the sum to the optimizer's fp32 gradients at the accumulation boundary, as it does for a
    buffer on the GPU. The values are those of DeepSpeed's own path, which also adds on the GPU and stores the sum in
    the same dtype. Returns whether it applied; the log says which path runs."""
    import itertools

    import torch
    from deepspeed.accelerator import get_accelerator

    views = "_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition"
    if not (getattr(optimizer, "offload_optimizer", False) and hasattr(optimizer, "grad_partitions_flat_buffer")
            and hasattr(optimizer, views)):
        return False
    if getattr(optimizer, "swap_optimizer", False) or getattr(optimizer, "zenflow", False):
        log("gradients: ZeRO-3 accumulates them in host memory (DeepSpeed's own path; NVMe and ZenFlow offload are "
            "not covered by patches.deepspeed_zero3)")
        return False
    if not gate(GRADIENT_BUFFER_ON_GPU, log):
        return False
    device = get_accelerator().current_device_name()
    old = optimizer.grad_partitions_flat_buffer
    buffer = torch.zeros(old.numel(), dtype=old.dtype, device=device)
    mapping = getattr(optimizer, views)
    offset = 0
    for param in itertools.chain.from_iterable(optimizer.fp16_groups):
        mapping[param.ds_id] = buffer.narrow(0, offset, param.partition_numel())
        offset += param.partition_numel()
    optimizer.grad_partitions_flat_buffer = buffer
    optimizer.inf_or_nan_tracker = torch.zeros(1, dtype=torch.bool, device=device)
    log(f"gradients: ZeRO-3 accumulates them on {device} ({buffer.numel() * buffer.element_size() / 2**30:.1f} GiB, "
        f"{buffer.dtype}) and copies the sum to the offloaded optimizer once per step (patches.deepspeed_zero3; "
        "--offload_grad_buffer host: DeepSpeed's pinned host buffer, copied both ways every micro-batch)")
    return True
