"""GPU_MEMORY_GIB: the size a run plans for, and beside a larger GPU the size PyTorch's allocator is held to. No GPU
exists on the test machines, so torch.cuda's answers about one (is_available, its properties, the fraction it is
given) are stand-ins here; the arithmetic and the decisions around them are the project's own."""

from types import SimpleNamespace

import pytest
import torch

from model_utils.planning.plan import gpu_memory_gib
from model_utils.runtime import distributed

GIB = 2**30


@pytest.fixture
def h200(monkeypatch):
    """A visible 139.8 GiB GPU (stand-in), and the fractions the allocator is given."""
    given = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: SimpleNamespace(total_memory=int(139.8 * GIB), name="NVIDIA H200"))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction",
                        lambda fraction, device: given.append((fraction, device)))
    return given


def test_a_smaller_size_beside_a_larger_gpu_is_planned_for_and_held_to(h200, monkeypatch):
    monkeypatch.setenv("GPU_MEMORY_GIB", "79.2")
    assert gpu_memory_gib() == (79.2, "GPU_MEMORY_GIB, of the NVIDIA H200's 139.8")
    assert distributed.cap_gpu_memory(3) == pytest.approx(79.2 / 139.8)
    assert h200 == [(pytest.approx(79.2 / 139.8), 3)]


@pytest.mark.parametrize("value", [None, "139.8", "200"])
def test_the_gpu_itself_where_no_smaller_size_is_given(h200, monkeypatch, value):
    if value is None:
        monkeypatch.delenv("GPU_MEMORY_GIB", raising=False)
    else:
        monkeypatch.setenv("GPU_MEMORY_GIB", value)
    memory, source = gpu_memory_gib()
    assert (round(memory, 1), source) == (139.8, "NVIDIA H200")
    assert distributed.cap_gpu_memory(0) is None and h200 == []


def test_without_a_gpu_the_size_is_the_one_given(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("GPU_MEMORY_GIB", "80")
    assert gpu_memory_gib() == (80.0, "GPU_MEMORY_GIB")
    monkeypatch.delenv("GPU_MEMORY_GIB")
    assert gpu_memory_gib() == (None, "no GPU visible here")


@pytest.mark.parametrize("value", ["80GB", "-4", "0", "nan"])
def test_a_size_that_is_not_a_positive_number_stops_the_run_naming_it(monkeypatch, value):
    monkeypatch.setenv("GPU_MEMORY_GIB", value)
    problems = distributed.distributed_env_problems()
    assert [(p.setting, p.value) for p in problems] == [("GPU_MEMORY_GIB", value)]
    assert "positive number of GiB" in problems[0].message and "GPU_MEMORY_GIB=79.2" in problems[0].fix
