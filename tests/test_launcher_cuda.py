"""CUDA_VERSION as NVIDIA's images set it (major.minor.patch), seen on the GPU test machine: it must select the
installed major.minor toolkit instead of failing."""

from __future__ import annotations

from test_launchers import lib, one_line_error, launch


def test_image_style_cuda_version_selects_the_major_minor_toolkit(tmp_path):
    (tmp_path / "cuda-13.0" / "bin").mkdir(parents=True)
    result = lib('select_cuda; echo "$CUDA_HOME"', CUDA_ROOT=str(tmp_path), CUDA_VERSION="13.0.2")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(tmp_path / "cuda-13.0")


def test_patch_version_of_an_absent_toolkit_still_fails_clearly(tmp_path):
    (tmp_path / "cuda-12.8").mkdir()
    result = launch("./train-singlenode.sh", CUDA_ROOT=str(tmp_path), CUDA_VERSION="13.0.2")
    one_line_error(result, "CUDA_VERSION=13.0.2 is not installed")
    assert "installed: 12.8" in result.stderr
