"""DeepSpeed's ZeRO-3 optimizer (DeepSpeedZeroOptimizer_Stage3) with a partial optimizer offload, made to checkpoint
all of its optimizer state.

With `"offload_optimizer": {"ratio": r}` (r < 1) DeepSpeed updates the first sub-groups of the optimizer partition on
the GPU with a torch AdamW of its own (`backup_optimizer`) and the rest on the host with its CPU Adam. Its
`state_dict` holds the CPU Adam's state only: a resume would restart the GPU part's Adam moments and step counts.

- PARTIAL_OFFLOAD_STATE: the GPU part's AdamW state is added to the optimizer's checkpoint (one entry per sub-group it
  updates) and put back when the checkpoint is loaded.
"""

from __future__ import annotations

from model_utils.patches import Patch, gate

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
