"""Each rank's share of the host's cores (runtime.process.host_threads): ranks started side by side without CPU masks of
their own split torch's threads among them, so their CPU optimizer updates do not run oversubscribed; a mask, a single
rank or OMP_NUM_THREADS keeps torch's own count."""

from __future__ import annotations

import os

from model_utils.runtime import distributed
from model_utils.runtime.process import host_threads


def test_ranks_without_masks_split_the_nodes_cores():
    threads, why = host_threads({"LOCAL_WORLD_SIZE": "8"}, cpus_in_mask=128, cpus_on_node=128, torch_default=64)
    assert threads == 8 and "torch's 64 for this node's cores, shared by its 8 ranks" in why
    threads, _ = host_threads({"LOCAL_WORLD_SIZE": "8"}, cpus_in_mask=4, cpus_on_node=4, torch_default=4)
    assert threads == 1  # more ranks than cores: one each, never zero


def test_a_mask_a_single_rank_or_omp_num_threads_keeps_torchs_count():
    # srun with CPU binding (or taskset) already narrowed the mask, and torch sized its threads to it
    threads, why = host_threads({"LOCAL_WORLD_SIZE": "8"}, cpus_in_mask=16, cpus_on_node=128, torch_default=16)
    assert threads is None and "of this rank's 16 CPUs" in why
    threads, why = host_threads({}, cpus_in_mask=128, cpus_on_node=128, torch_default=64)
    assert threads is None and "torch's default" in why
    threads, why = host_threads({"LOCAL_WORLD_SIZE": "8", "OMP_NUM_THREADS": "4"}, 128, 128, 4)
    assert threads is None and why == "OMP_NUM_THREADS=4"


def test_an_srun_step_states_the_ranks_on_each_node(monkeypatch):
    """A plain srun step (no launcher of this project): the trainer maps SLURM's task variables, LOCAL_WORLD_SIZE
    included, from --ntasks-per-node."""
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "TORCH_CUDA_ARCH_LIST"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    for name, value in {"SLURM_STEP_ID": "0", "SLURM_NTASKS": "16", "SLURM_PROCID": "9", "SLURM_LOCALID": "1",
                        "SLURM_NTASKS_PER_NODE": "8"}.items():
        monkeypatch.setenv(name, value)
    assert distributed.distributed_env_problems() == []
    assert (os.environ["RANK"], os.environ["LOCAL_RANK"], os.environ["LOCAL_WORLD_SIZE"]) == ("9", "1", "8")

