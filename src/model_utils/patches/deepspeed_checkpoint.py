"""DeepSpeed's universal checkpoint conversion (`deepspeed.checkpoint.ds_to_universal`) of a sequence-parallel
checkpoint.

DeepSpeed's Ulysses parallel state (`deepspeed.runtime.sequence_parallel.parallel_state_sp`) answers the engine's
model-parallel questions with the sequence-parallel group, so a checkpoint saved with `--sequence_parallel N` records
tensor parallelism N in its model-state file (`CHECKPOINT_PARALLEL_DIMS`), while its ranks held whole weights and wrote
one model-state file and one ZeRO partition each, as data-parallel ranks do. `ds_to_universal` then stops: "Checkpoint
model-state file count 1 does not match pp_degree=1 * tp_degree=N".

- SEQUENCE_PARALLEL_UNIVERSAL: the conversion reads a view of the checkpoint (every file linked, the model-state
  files written again with tensor parallelism 1), which is what the ranks saved; the universal checkpoint it writes
  loads on any number of GPUs, split or not.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from model_utils.patches import Patch, gate

SEQUENCE_PARALLEL_UNIVERSAL = Patch(
    "deepspeed", "0.19.8", "0.19.8",
    "deepspeed.checkpoint.ds_to_universal on a view of a sequence-parallel checkpoint whose model-state files record "
    "tensor parallelism 1 (their CHECKPOINT_PARALLEL_DIMS entry, written by DeepSpeed from the Ulysses parallel "
    "state's model-parallel size)",
    "correctness, not speed: without it a --sequence_parallel checkpoint cannot resume on another number of GPUs "
    "(ds_to_universal stops on the tensor parallelism it reads)",
    ("tests/distributed/test_sequence_parallel_runs.py::"
     "test_a_split_runs_checkpoint_resumes_on_its_gpus_without_the_split_and_on_one_through_the_universal_path",
     "tests/unit/patches/test_patches.py::test_the_data_parallel_view_of_a_split_checkpoint_records_no_tensor_parallelism"))


def converts_sequence_parallel(log=None) -> bool:
    """Whether this DeepSpeed's universal conversion takes a sequence-parallel checkpoint through the view."""
    return gate(SEQUENCE_PARALLEL_UNIVERSAL, log)


def data_parallel_view(checkpoint: Path, view: Path) -> Path:
    """`view`, a directory beside `checkpoint` holding a link to each of its files except the model-state files
    (mp_rank_*_model_states.pt), written again there with tensor parallelism 1 in their CHECKPOINT_PARALLEL_DIMS."""
    import torch
    from deepspeed.checkpoint.constants import CHECKPOINT_PARALLEL_DIMS, CHECKPOINT_TP_DEGREE

    shutil.rmtree(view, ignore_errors=True)
    view.mkdir(parents=True)
    for path in sorted(checkpoint.iterdir()):
        if path.name.startswith("mp_rank_") and path.name.endswith("_model_states.pt"):
            state = torch.load(path, map_location="cpu", weights_only=False)
            dims = state.get(CHECKPOINT_PARALLEL_DIMS)
            if isinstance(dims, dict):
                state[CHECKPOINT_PARALLEL_DIMS] = {**dims, CHECKPOINT_TP_DEGREE: 1}
            torch.save(state, view / path.name)
        else:
            (view / path.name).symlink_to(path.resolve(), target_is_directory=path.is_dir())
    return view
