"""The run lock between real runs (2 CPU ranks each): a second run on the same checkpoint directory refuses at once
and leaves the first untouched; locks of other hosts are taken over when stale or forced, refused when alive."""

from __future__ import annotations

import json
import socket
import time

import pytest
from conftest import FAST_ARGS, Trainer, assert_ok, run_trainer
from inputs import write_lock

from model_utils.core.run_dir import LOCK
from model_utils.runtime.run_lock import STALE_S


def test_second_run_on_the_same_directory_refuses_at_once(session_cache, tmp_path):
    ckpt = tmp_path / "ckpt"
    args = [*FAST_ARGS, "--max_steps", "60", "--checkpoint_freq", "20", "--no-export"]
    first = Trainer(ckpt, args)
    assert first.wait_for(lambda: (ckpt / "metrics.jsonl").exists())  # training
    t0 = time.monotonic()
    second = run_trainer(ckpt, args)
    refused_in = time.monotonic() - t0
    holder = json.loads((ckpt / LOCK).read_text())
    assert second.returncode == 2 and "Traceback" not in second.output
    assert f"--checkpoint_dir = {ckpt}: is in use by another run (host {socket.gethostname()}, pid {holder['pid']}" \
           in second.output and "--force_unlock" in second.output
    assert holder["pid"] == first.procs[0].pid  # rank 0 of the first run holds it
    assert refused_in < 60
    first_run = first.wait()
    assert_ok(first_run)
    assert [r["step"] for r in first_run.train_records()] == list(range(1, 61))  # untouched by the second
    assert not (ckpt / LOCK).exists()  # released at the end


@pytest.mark.parametrize("age, extra, taken", [(STALE_S + 60, [], True), (0, [], False), (0, ["--force_unlock"], True)],
                         ids=["stale", "alive-elsewhere", "forced"])
def test_locks_of_other_hosts(session_cache, tmp_path, age, extra, taken):
    ckpt = tmp_path / "ckpt"
    write_lock(ckpt, age_s=age)
    run = run_trainer(ckpt, [*FAST_ARGS, "--max_steps", "2", "--no-export", *extra])
    if taken:
        assert_ok(run)
        assert "run lock: taking over" in run.output and "node-elsewhere pid 4242" in run.output
    else:
        assert run.returncode == 2 and "is in use by another run (host node-elsewhere, pid 4242" in run.output
        assert (ckpt / LOCK).exists()  # theirs, left alone
