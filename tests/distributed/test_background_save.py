"""Checkpoints written in the background (--background_checkpoint, the default): the same files as a synchronous
save, byte for byte; visible only once every rank has written them; a failed write stops the run with the previous
checkpoint intact. Kill -9 and USR1 during a background write: tests/distributed/test_save_faults.py."""

from __future__ import annotations

import io
import json
import types
from collections import OrderedDict

import pytest
import torch
from conftest import assert_ok, gpu_count, run_python_on_gpus, run_trainer
from test_save_faults import run_with_fault
from test_training import RESUME_ARGS

from model_utils.checkpoint.background import HostBuffers, host_copy, moments_to_come, storage_sizes


def saved_bytes(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def test_host_copy_pickles_exactly_as_the_original():
    """What the state shares stays shared in the copy, so torch.save writes the same bytes: tied weights, views of a
    flat buffer, a tuple used by two param groups, a state dict's _metadata, requires_grad, Parameters, sizes."""
    flat = torch.arange(12, dtype=torch.float32)
    embedding = torch.randn(4, 3)
    module = OrderedDict([("embed.weight", embedding), ("head.weight", embedding), ("a", flat[:6].view(2, 3)),
                          ("b", flat[6:])])
    module._metadata = OrderedDict([("", {"version": 1})])
    betas = (0.9, 0.95)
    master = torch.randn(5, requires_grad=True)
    placeholder = torch.empty(0)
    master.ds_id = "0_42"  # an attribute ZeRO-3 sets, which torch.save keeps
    state = {"module": module, "groups": [{"betas": betas, "lr": 1e-3}, {"betas": betas, "lr": 0.0}],
             "fp32": [master], "param": torch.nn.Parameter(torch.ones(2)), "shape": torch.Size([2, 3]),
             "step": 7, "half": flat.to(torch.bfloat16)[2:5],
             # ZeRO-3's partitioned parameters: empty, distinct storages, but one for a tied weight
             "placeholders": [torch.empty(0), torch.empty(0), placeholder, placeholder.detach()]}
    copy = host_copy(state)
    assert saved_bytes(copy) == saved_bytes(state)
    assert copy["module"]["embed.weight"] is not embedding  # a copy, not the live tensor
    assert copy["module"]["embed.weight"].untyped_storage().data_ptr() == \
        copy["module"]["head.weight"].untyped_storage().data_ptr()
    assert copy["groups"][0]["betas"] is copy["groups"][1]["betas"] and copy["module"]._metadata == module._metadata
    embedding.add_(1.0)  # training goes on: the copy keeps the state as it was
    assert saved_bytes(copy) != saved_bytes(state)

    # Into reused buffers (what each save after the first does): the same bytes, no new storage.
    buffers, memo = HostBuffers(pinned=False), {"taken": []}
    first = host_copy(state, memo, buffers)
    expected = saved_bytes(state)
    assert saved_bytes(first) == expected and memo["taken"]
    buffers.give_back(memo["taken"])
    again = {"taken": []}
    second = host_copy(state, again, buffers)
    assert saved_bytes(second) == expected
    assert {s.data_ptr() for s in again["taken"]} == {s.data_ptr() for s in memo["taken"]}
    assert buffers.fresh_bytes == sum(s.nbytes() for s in memo["taken"])  # the first copy allocated, not the second

    # Reserved ahead (HostCopyWriter.reserve, beside training): the storages the copy takes, each shared one once.
    sizes = storage_sizes(state)
    assert sorted(sizes) == sorted(s.nbytes() for s in memo["taken"])
    reserved = HostBuffers(pinned=False)
    reserved.reserve(sizes)
    reserved.reserve(sizes[:2])  # storages already free count: nothing more is allocated
    assert sum(len(free) for free in reserved._free.values()) == len(sizes)
    early = {"taken": []}
    assert saved_bytes(host_copy(state, early, reserved)) == expected and reserved.fresh_bytes == 0


def test_zero3_adam_moments_are_reserved_before_the_first_update_makes_them():
    """ZeRO-3's state before the first update: its fp32 partitions, no moments (torch's Adam makes them lazily). The
    reservation beside the first step counts Adam's two moments per partition, each of the partition's size; once
    they exist, or for an optimizer that is not Adam, none are predicted."""
    class FusedAdam:  # the name is what counts: DeepSpeed's FusedAdam, DeepSpeedCPUAdam, torch's Adam and AdamW
        pass

    flat = [torch.zeros(10), torch.zeros(6)]
    before = {"optimizer_state_dict": {"state": {}, "param_groups": []}, "fp32_flat_groups": flat}
    assert sorted(moments_to_come(types.SimpleNamespace(optimizer=FusedAdam()), before)) == [24, 24, 40, 40]
    after = {**before, "optimizer_state_dict": {"state": {0: {"exp_avg": torch.zeros(10)}}, "param_groups": []}}
    assert moments_to_come(types.SimpleNamespace(optimizer=FusedAdam()), after) == []
    assert moments_to_come(types.SimpleNamespace(optimizer=torch.optim.SGD([torch.zeros(1)], lr=0.1)), before) == []


def test_an_optimizer_state_that_cannot_be_read_between_steps_leaves_the_saves_to_allocate():
    """Where the engine's optimizer cannot give its state dict before the first step, the run says so once and trains
    on; its saves allocate their host memory as they copy (what HostBuffers.take does without a reservation)."""
    from model_utils.checkpoint.background import BackgroundSaves

    class Writer:
        def reserve(self, engine, save_options):
            raise NotImplementedError("ZeRO-3 elastic checkpointing is deprecated")

    lines = []
    saves = BackgroundSaves(Writer(), dist=None, log=lines.append)
    for _ in range(4):
        saves.reserve_buffers(engine=None, save_options={})
    assert lines == ["checkpoint: host memory for the saves not reserved ahead (NotImplementedError: ZeRO-3 elastic "
                     "checkpointing is deprecated); each save allocates what it lacks"]


PINNED_SAVE_CHECK = """
import io
import torch
from model_utils.checkpoint.background import HostBuffers, host_copy

def saved_bytes(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()

state = {"odd": torch.randn(3 * 2**20 + 7, device="cuda"), "half": torch.randn(1000, dtype=torch.bfloat16,
                                                                              device="cuda")}
buffers, memo = HostBuffers(pinned=True), {"taken": []}
copy = host_copy(state, memo, buffers)
torch.cuda.synchronize()
assert sorted(s.nbytes() for s in memo["taken"]) == sorted(t.untyped_storage().nbytes() for t in state.values())
assert all(t.is_pinned() for t in copy.values())
assert saved_bytes(copy) == saved_bytes({k: v.cpu() for k, v in state.items()})
print("pinned save ok")
"""


@pytest.mark.skipif(gpu_count() == 0, reason="pinned host memory needs a GPU (run by run_device.sh's gpu-tests plan; "
                                             "CI's machines have none)")
def test_pinned_save_buffers_copy_from_the_gpu_exactly():
    """HostBuffers' pinned storages, as the trainer allocates them (runtime.process.pin_host_memory_by_threads): the
    storages' own sizes, pinned, and a copy from the GPU into them pickles as the GPU state does. On a GPU (the
    session hides them: a subprocess with them visible)."""
    done = run_python_on_gpus(PINNED_SAVE_CHECK)
    assert done.returncode == 0 and "pinned save ok" in done.stdout, done.stderr[-2000:]


@pytest.mark.parametrize("ds_config", ["ds_config.json", "configs/zero3.json"])
def test_background_files_equal_a_synchronous_save(session_cache, tmp_path, ds_config):
    """Two runs, same seed: every file of step 3 (DeepSpeed's model and optimizer states, the RNG states) is
    byte-identical whether written in the background or not; the background run says when each became complete, and
    its saves copied into host memory reserved beside its first steps, allocating none themselves."""
    args = [*RESUME_ARGS, "--checkpoint_freq", "3", "--max_steps", "6", "--ds_config", ds_config]
    background = run_trainer(tmp_path / "background", args)
    synchronous = run_trainer(tmp_path / "synchronous", [*args, "--no-background_checkpoint"])
    assert_ok(background)
    assert_ok(synchronous)
    out = background.output
    assert "checkpoint: step 3 in host memory after" in out and "writing it in the background" in out
    assert "checkpoint: step-00000003 complete, written in the background" in out
    assert "checkpoint writes: synchronous (--no-background_checkpoint)" in synchronous.output
    first, second = tmp_path / "background/step-00000003", tmp_path / "synchronous/step-00000003"
    names = sorted(f.name for f in first.iterdir() if f.is_file())
    assert names == sorted(f.name for f in second.iterdir() if f.is_file())
    assert any(n.startswith("zero_pp_rank_1") for n in names) and "rng_state_rank00001.pt" in names
    for name in names:
        if name != "manifest.json":
            assert (first / name).read_bytes() == (second / name).read_bytes(), name
    manifests = [json.loads((d / "manifest.json").read_text()) for d in (first, second)]
    assert manifests[0]["files"] == manifests[1]["files"]
    stalls = [r["checkpoint_s"] for r in background.metrics() if "checkpoint_s" in r]
    assert len(stalls) == 2
    # The host memory of the saves was reserved beside the first steps: no save allocated any itself.
    assert "GiB of host memory for this rank's saves, beside training" in out
    assert [r["checkpoint_unreserved_host_gib"] for r in background.metrics()
            if "checkpoint_unreserved_host_gib" in r] == [0.0, 0.0]


def test_a_save_that_waits_for_the_previous_writes_is_told_with_the_time(session_cache, tmp_path):
    """Rank 1's writes of step 2 last until the save of step 4 begins and a second more (a disk slower than the save
    interval, injected): step 4's save says how long it waited for step 2's writes and what to change; the metrics
    hold the wait and each checkpoint's background write, and the run summary adds them up."""
    ckpt = tmp_path / "ckpt"
    run = run_with_fault(ckpt, [*RESUME_ARGS, "--checkpoint_freq", "2", "--max_steps", "4"], "slow-write:1:2")
    assert run.returncodes == [0, 0], run.outputs[0][-3000:]
    out = run.outputs[0]
    assert "checkpoint: step 4 waited " in out and "s for step 2's writes (they took " in out
    assert "save less often (--checkpoint_freq, --checkpoint_minutes) or to a faster filesystem" in out
    records = [json.loads(line) for line in (ckpt / "metrics.jsonl").read_text().splitlines()]
    waits = {r["step"]: r["checkpoint_wait_s"] for r in records if "checkpoint_wait_s" in r}
    writes = {r["step"]: r["checkpoint_write_s"] for r in records if "checkpoint_write_s" in r}
    assert waits[2] < 0.5 <= 1.0 <= waits[4] and set(writes) == {2, 4} and writes[2] >= 1.0
    summary = json.loads((ckpt / "summary.json").read_text())
    assert summary["checkpoint_wait_s_total"] == pytest.approx(waits[2] + waits[4])
    assert summary["checkpoint_write_s_max"] == pytest.approx(max(writes.values()))
    assert "s of it waiting for previous writes; background writes " in out
    assert (ckpt / "latest").read_text() == "step-00000004"


def test_a_failed_background_write_stops_the_run_and_keeps_the_previous_checkpoint(session_cache, tmp_path):
    """Rank 1's writes of step 6 fail (ENOSPC, injected): every rank learns it at the next step's collective and
    exits 1 with the reason; step 3 stays `latest`, step 6 never gets a manifest, and a new run resumes from 3."""
    ckpt = tmp_path / "ckpt"
    args = [*RESUME_ARGS, "--checkpoint_freq", "3"]
    failed = run_with_fault(ckpt, args, "disk-full:1:6")
    assert failed.returncodes == [1, 1], failed.outputs[1][-3000:]
    assert f"checkpoint step-00000006 could not be written (no space left on the filesystem of {ckpt}: " \
        in failed.outputs[1]
    assert "No space left on device" in failed.outputs[1]
    assert "a write failed on another rank" in failed.outputs[0]
    assert "the previous complete checkpoint stays `latest`" in failed.outputs[0]
    assert not any("Traceback" in o for o in failed.outputs), failed.outputs[0][-3000:]
    assert (ckpt / "latest").read_text() == "step-00000003"
    assert not (ckpt / "step-00000006" / "manifest.json").exists()
    resumed = run_trainer(ckpt, args)
    assert_ok(resumed)
    assert "resume: continuing from" in resumed.output and "step-00000003" in resumed.output
