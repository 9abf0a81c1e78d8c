"""A failed checkpoint write names its cause. Each case makes torch.save (what DeepSpeed's checkpoint engine and the
background writer call) fail for real: a full tmpfs, a tmpfs remounted read-only, a directory marked immutable on the
disk (which stops root too), a directory removed; checkpoint.save.write_failure reads the error the OS gave."""

from __future__ import annotations

import errno
import json
import shutil
import subprocess

import pytest
import torch
from inputs import mounted_tmpfs

from model_utils.checkpoint.save import save_failed, write_failure
from model_utils.core.run_dir import MANIFEST


@pytest.fixture
def small_fs(tmp_path):
    """A 256 KiB tmpfs."""
    yield from mounted_tmpfs(tmp_path / "fs", "256k")


def _previous_checkpoint(ckpt, size: int):
    """A complete checkpoint of `size` bytes (step 2), as commit_save leaves it."""
    step = ckpt / "step-00000002"
    step.mkdir(parents=True)
    (step / "mp_rank_00_model_states.pt").write_bytes(b"x" * size)
    (step / MANIFEST).write_text(json.dumps({"step": 2, "files": {"mp_rank_00_model_states.pt": size}}))


def _failed_save(path, numel: int = 10):
    with pytest.raises((OSError, RuntimeError)) as caught:
        torch.save(torch.zeros(numel), str(path))
    return caught.value


def test_a_full_disk_names_the_free_bytes_those_written_and_the_size_of_a_checkpoint(small_fs):
    ckpt = small_fs / "ckpt"
    _previous_checkpoint(ckpt, 60_000)
    (ckpt / "step-00000004").mkdir()
    target = ckpt / "step-00000004" / "mp_rank_00_model_states.pt"
    error = _failed_save(target, numel=100_000)  # 400 kB into what is left of 256 KiB
    assert "unexpected pos" in str(error) or "file write failed" in str(error)  # torch's words: no errno
    cause, fix = write_failure(error, target)
    free, written = shutil.disk_usage(small_fs).free, target.stat().st_size
    assert cause.startswith(f"no space left on the filesystem of {ckpt}: {free:,} bytes free of 262,144; "
                            f"{written:,} bytes of step-00000004 written so far; a checkpoint takes about 60,000 bytes "
                            f"(the size of step-00000002); writing mp_rank_00_model_states.pt: "), cause
    assert fix.startswith(f"free space on the filesystem of {ckpt}")
    message = str(save_failed("step-00000004", cause, fix))
    assert message.startswith("checkpoint step-00000004 could not be written (no space left on the filesystem of")
    assert "the previous complete checkpoint stays `latest`. Fix: free space" in message

    # The same full disk met by a plain write (DeepSpeed's and our own files): an OSError with its errno.
    with pytest.raises(OSError) as caught:
        with open(ckpt / "step-00000004" / "rng_state_rank00000.pt", "wb") as f:
            f.write(b"x" * 300_000)
    assert caught.value.errno == errno.ENOSPC
    assert write_failure(caught.value, ckpt / "step-00000004" / "rng_state_rank00000.pt")[0].startswith(
        f"no space left on the filesystem of {ckpt}: ")


def test_a_read_only_filesystem_is_named(small_fs):
    ckpt = small_fs / "ckpt"
    (ckpt / "step-00000004").mkdir(parents=True)
    subprocess.run(["mount", "-o", "remount,ro", str(small_fs)], check=True)
    target = ckpt / "step-00000004" / "mp_rank_00_model_states.pt"
    cause, fix = write_failure(_failed_save(target), target)
    assert cause.startswith(f"the filesystem of {ckpt} is read-only (writing {target}: "), cause
    assert fix == "remount it read-write, or point --checkpoint_dir at a writable filesystem"


def test_a_directory_that_denies_writes_is_named(tmp_path):
    """chattr +i: an immutable directory refuses new files with EPERM even to root (chmod would not stop root)."""
    step = tmp_path / "ckpt" / "step-00000004"
    step.mkdir(parents=True)
    done = subprocess.run(["chattr", "+i", str(step)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"this filesystem has no immutable attribute: {done.stderr.strip()}")
    try:
        target = step / "mp_rank_00_model_states.pt"
        error = _failed_save(target)
        cause, fix = write_failure(error, target)
        with pytest.raises(PermissionError) as caught:  # a plain write is refused alike, with its errno
            open(step / "rng_state_rank00000.pt", "wb")
        plain, _ = write_failure(caught.value, step / "rng_state_rank00000.pt")
    finally:
        subprocess.run(["chattr", "-i", str(step)], check=True)
    assert cause.startswith(f"permission denied writing {target} (user id 0: "), cause
    assert "Operation not permitted" in cause
    assert fix.startswith(f"make {step} writable for this user (an immutable attribute, lsattr, stops root too)")
    assert plain.startswith(f"permission denied writing {step / 'rng_state_rank00000.pt'} (user id 0: ")


def test_a_vanished_directory_is_named(tmp_path):
    step = tmp_path / "ckpt" / "step-00000004"
    step.mkdir(parents=True)
    shutil.rmtree(step)  # as a cleanup job or another run would
    target = step / "mp_rank_00_model_states.pt"
    cause, fix = write_failure(_failed_save(target), target)
    assert cause.startswith(f"{step} vanished while it was being written (deleted, or its filesystem unmounted): ")
    with pytest.raises(FileNotFoundError) as caught:
        open(target, "wb")
    assert write_failure(caught.value, target)[0].startswith(f"{step} vanished while it was being written")
    assert fix.startswith(f"keep other jobs and cleanups away from {tmp_path / 'ckpt'}")


def test_another_error_is_reported_as_it_came(tmp_path):
    target = tmp_path / "ckpt" / "step-00000004" / "x.pt"
    cause, fix = write_failure(RuntimeError("some library's own failure"), target)
    assert cause == f"writing {target} failed: some library's own failure"
