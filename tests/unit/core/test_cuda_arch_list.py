"""TORCH_CUDA_ARCH_LIST as DeepSpeed's op builder reads it (model_utils/core/cuda_arch.py, used by the trainer and the
launchers): arch-specific suffixes such as 9.0a, which torch's images set, become what DeepSpeed can parse; a
malformed entry is a problem reported before any work."""

from __future__ import annotations

import pytest

from model_utils.runtime import distributed


@pytest.mark.parametrize("given, expected", [
    ("9.0a", "9.0"), ("8.0;9.0a", "8.0;9.0"), ("9.0a+PTX", "9.0+PTX"), ("10.0f 9.0a", "10.0;9.0"), ("9.0;9.0a", "9.0"),
])
def test_cuda_arch_list_is_normalised_for_deepspeed(monkeypatch, given, expected):
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", given)
    assert distributed.normalize_cuda_arch_list() == expected
    for item in expected.split(";"):
        major, minor = item.replace("+PTX", "").split(".")
        int(major), int(minor)  # what DeepSpeed's op builder does


def test_a_malformed_entry_is_a_problem_before_any_work(monkeypatch):
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0;sm_90")
    problems = distributed.distributed_env_problems()
    assert [p.setting for p in problems] == ["TORCH_CUDA_ARCH_LIST"]
    assert "entry 'sm_90' is not like 9.0" in problems[0].message and "8.0;9.0" in problems[0].fix


def test_cuda_arch_list_unset_stays_unset(monkeypatch):
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    assert distributed.normalize_cuda_arch_list() is None
