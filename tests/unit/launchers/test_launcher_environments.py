"""CUDA_VERSION as NVIDIA's images set it (major.minor.patch), seen on the GPU test machine: it must select the
installed major.minor toolkit instead of failing."""

from __future__ import annotations

import pytest
from launching import commands, launch, lib, one_line_error
from slurm_fixtures import REPO_ROOT


def test_image_style_cuda_version_selects_the_major_minor_toolkit(tmp_path):
    (tmp_path / "cuda-13.0" / "bin").mkdir(parents=True)
    result = lib('select_cuda; echo "$CUDA_HOME"', CUDA_ROOT=str(tmp_path), CUDA_VERSION="13.0.2")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(tmp_path / "cuda-13.0")


def fake_nvcc(tmp_path, release):
    """A stand-in nvcc on PATH (this machine may or may not have a CUDA toolkit)."""
    import os

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    nvcc = bin_dir / "nvcc"
    nvcc.write_text(f"#!/bin/sh\necho 'Cuda compilation tools, release {release}, V{release}.0'\n")
    nvcc.chmod(0o755)
    return f"{bin_dir}:{os.environ['PATH']}"


def test_patch_version_of_an_absent_toolkit_still_fails_clearly(tmp_path):
    (tmp_path / "cuda-12.8").mkdir()
    result = launch("./train-singlenode.sh", CUDA_ROOT=str(tmp_path), CUDA_VERSION="13.0.2",
                    PATH=fake_nvcc(tmp_path, "12.8"), timeout=30)
    one_line_error(result, "CUDA_VERSION=13.0.2 is not installed")
    assert "installed: 12.8" in result.stderr


# CSCS Alps: the Container Engine (Pyxis with EDFs) does not exist here; the composed srun line is what is tested.
def test_cscs_edf_replaces_image_and_mounts(tmp_path):
    edf = tmp_path / "trainer.toml"
    edf.write_text(f'image = "/x.sqsh"\nmounts = ["{REPO_ROOT}:{REPO_ROOT}"]\nworkdir = "{REPO_ROOT}"\n')
    result = launch("./train-pyxis-singlenode.sh", "--seed", "1", DRY_RUN="1", CONTAINER_EDF=str(edf))
    assert result.returncode == 0, result.stderr
    srun = commands(result)[1]
    assert f"--environment={edf} bash -c " in srun and "--container-image" not in srun
    assert srun.endswith(" _ python src/train_deepspeed.py --seed 1")  # the same training command


def test_cscs_edf_by_name_and_missing_edf(tmp_path):
    (tmp_path / ".edf").mkdir()
    (tmp_path / ".edf" / "trainer.toml").write_text(f'workdir = "{REPO_ROOT}"\n')
    result = launch("./train-pyxis-singlenode.sh", DRY_RUN="1", CONTAINER_EDF="trainer", HOME=str(tmp_path))
    assert result.returncode == 0 and "--environment=trainer " in commands(result)[1], result.stderr
    one_line_error(launch("./train-pyxis-singlenode.sh", CONTAINER_EDF="nope", HOME=str(tmp_path)),
                   f"CONTAINER_EDF=nope: no {tmp_path}/.edf/nope.toml")


def test_shipped_edf_template_is_valid_toml():
    import tomllib

    edf = tomllib.loads((REPO_ROOT / "configs" / "cscs-edf.toml").read_text())
    assert {"image", "mounts", "workdir", "annotations", "env"} <= edf.keys()
    assert edf["annotations"]["com"]["hooks"]["aws_ofi_nccl"]["enabled"] == "true"  # dotted keys nest


def test_cuda_version_of_the_toolkit_already_on_path_is_accepted(tmp_path):
    """Inside a container that exports CUDA_VERSION and has its toolkit on PATH but no CUDA_ROOT/cuda-X.Y directory.
    nvcc is a stand-in here (no CUDA toolkit on this machine)."""
    path = fake_nvcc(tmp_path, "12.9")
    ok = lib("select_cuda", CUDA_ROOT=str(tmp_path), CUDA_VERSION="12.9.1", PATH=path)
    assert ok.returncode == 0 and "the toolkit already on PATH" in ok.stdout, ok.stderr
    bad = lib("select_cuda", CUDA_ROOT=str(tmp_path), CUDA_VERSION="12.8", PATH=path)
    assert bad.returncode == 1 and "CUDA_VERSION=12.8 is not installed" in bad.stderr


@pytest.mark.parametrize("left, seconds, signal_name, requeue", [
    ("1-02:03:04", 93784, "TERM", False),   # scancel a day before the limit: stays stopped
    ("45:00", 2700, "TERM", False),
    ("1:30", 90, "TERM", True),             # TERM at the time limit: requeued
    ("INVALID", 0, "TERM", True),
    ("UNLIMITED", -1, "TERM", False),
    ("45:00", 2700, "USR1", True),          # SLURM's warning signal always requeues
])
def test_requeue_decision_after_a_signal(tmp_path, left, seconds, signal_name, requeue):
    """squeue is a stand-in here (its time-left column is what the decision reads)."""
    import os

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "squeue").write_text(f"#!/bin/sh\necho '{left}'\n")
    (bin_dir / "squeue").chmod(0o755)
    result = lib('echo "$(job_seconds_left)"; stopped_for_time && echo requeue || echo stay',
                 PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_ID="7", FORWARDED_SIGNAL=signal_name)
    assert result.stdout.split() == [str(seconds), "requeue" if requeue else "stay"], result.stderr
