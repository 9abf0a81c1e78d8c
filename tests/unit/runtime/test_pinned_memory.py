"""How each rank pins host memory (runtime.process.pin_host_memory_by_threads): PyTorch's pinned memory mapped by 8
threads and registered with CUDA, added to the allocator settings the user has, unless the user chose the pinning."""

from __future__ import annotations

import pytest

from model_utils.runtime.process import PINNED_MEMORY_SETTINGS, pin_host_memory_by_threads, pinned_memory_line


@pytest.mark.parametrize("environ, key, expected", [
    ({}, "PYTORCH_CUDA_ALLOC_CONF", PINNED_MEMORY_SETTINGS),
    ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, "PYTORCH_CUDA_ALLOC_CONF",
     "expandable_segments:True," + PINNED_MEMORY_SETTINGS),
    ({"PYTORCH_ALLOC_CONF": "expandable_segments:True"}, "PYTORCH_ALLOC_CONF",
     "expandable_segments:True," + PINNED_MEMORY_SETTINGS),
    ({"PYTORCH_CUDA_ALLOC_CONF": "pinned_use_cuda_host_register:False"}, "PYTORCH_CUDA_ALLOC_CONF",
     "pinned_use_cuda_host_register:False"),  # the user's choice of pinning stays
])
def test_pinned_memory_is_mapped_by_threads_unless_the_user_chose(environ, key, expected):
    pin_host_memory_by_threads(environ)
    assert environ[key] == expected
    assert (key == "PYTORCH_ALLOC_CONF") == ("PYTORCH_CUDA_ALLOC_CONF" not in environ)
    line = pinned_memory_line(environ)
    assert line.startswith("pinned host memory: pages mapped by 8 threads" if PINNED_MEMORY_SETTINGS in expected
                           else f"pinned host memory: as {key} sets it")
