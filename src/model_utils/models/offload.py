"""--offload_activations (ALST's checkpoint offload): what a micro-batch's forward keeps for its backward pass goes to host
memory and comes back in the backward pass, through torch's saved-tensor hooks. With checkpointing that is each
recomputed layer's input and what the parts outside the layers keep; the recomputation in the backward pass runs on
the GPU.

The large tensors (`OFFLOAD_EXACT_BYTES` and up: the layers' inputs at long sequences) go to host buffers of their
exact size, pinned on GPUs, kept and reused from micro-batch to micro-batch. torch.autograd.graph.save_on_cpu takes its
copies from PyTorch's pinned allocator instead, which rounds each allocation up to a power of two: 32 inputs of 3 GiB
(Llama 3.1 8B at 393,216 tokens) would take 128 GiB of host memory instead of 96. The smaller ones go the way
save_on_cpu takes them."""

from __future__ import annotations

import sys
from collections import defaultdict
from contextlib import contextmanager

import torch

from model_utils.models.memory import OFFLOAD_EXACT_BYTES


class HostActivations:
    """Host buffers for the saved tensors of micro-batch forwards (`saving()`), pinned where `pinned` (a GPU run): a
    buffer returns to the pool when autograd releases the saved tensor it holds (after the backward pass read it) and
    serves the next tensor of its exact size, the GPU ordering the copy into it after the copy out of it. Shapes repeat
    from micro-batch to micro-batch (blocks of --seq_len tokens), so after the first micro-batch nothing is allocated; a
    size that does not recur is released at the next miss."""

    def __init__(self, pinned: bool, pooled_bytes: int = OFFLOAD_EXACT_BYTES):
        self.pinned = pinned
        self.pooled_bytes = pooled_bytes
        self.free: dict[int, list[_Buffer]] = defaultdict(list)
        self.held_bytes = 0  # in the pool's buffers, in use or free
        self.allocations = 0  # buffers allocated (a steady run stops counting after its first micro-batch)
        self.told = False

    @contextmanager
    def saving(self):
        """While active (a micro-batch's forward), every tensor autograd saves is held in host memory."""
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield

    def tell_once(self, log) -> None:
        """After the first step: the host memory its saved tensors took in exact-size buffers (the preflight's estimate
        of the layers' inputs is beside it in the run's log)."""
        if self.told:
            return
        self.told = True
        small = f"tensors below {self.pooled_bytes / 1024**2:.0f} MiB in PyTorch's {'pinned ' * self.pinned}host cache"
        if not self.allocations:
            log.info(f"offloaded activations: {small} (none larger)")
            return
        log.info(f"offloaded activations: {self.held_bytes / 1024**3:.1f} GiB of {'pinned ' * self.pinned}host memory "
                 f"in {self.allocations} buffers of their tensors' exact sizes, reused every micro-batch; {small}")

    def _pack(self, tensor: torch.Tensor):
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes == 0 or nbytes < self.pooled_bytes or tensor.is_sparse or tensor.layout != torch.strided:
            return self._pack_small(tensor)
        buffer = self._take(nbytes)
        host = buffer.data.view(tensor.dtype).view(tensor.shape)
        host.copy_(tensor, non_blocking=self.pinned)
        buffer.record_copy()
        return _Held(self, buffer, host, tensor.device)

    def _pack_small(self, tensor: torch.Tensor):
        """As torch.autograd.graph.save_on_cpu packs it."""
        if not self.pinned:
            return tensor.device, tensor.cpu()
        packed = torch.empty(tensor.size(), dtype=tensor.dtype, layout=tensor.layout, pin_memory=not tensor.is_sparse)
        packed.copy_(tensor, non_blocking=True)
        return tensor.device, packed

    def _unpack(self, packed) -> torch.Tensor:
        if isinstance(packed, _Held):
            return packed.back()
        device, tensor = packed
        return tensor.to(device, non_blocking=self.pinned)

    def _take(self, nbytes: int) -> _Buffer:
        if self.free[nbytes]:
            buffer = self.free[nbytes].pop()
            buffer.order_after_copies()  # the GPU copies into it wait for those from it, the host does not
            return buffer
        for size in [size for size, buffers in self.free.items() if buffers]:  # sizes of an earlier shape
            for stale in self.free.pop(size):
                self._release(stale)
        buffer = _Buffer(nbytes, self.pinned)
        self.allocations += 1
        self.held_bytes += nbytes
        return buffer

    def _give_back(self, buffer: _Buffer) -> None:
        self.free[buffer.nbytes].append(buffer)

    def _release(self, buffer: _Buffer) -> None:
        self.held_bytes -= buffer.nbytes
        buffer.unpin()  # after its last copy, either way


class _Buffer:
    """`nbytes` of host memory; on GPUs, pinned where they lie (cudaHostRegister: exactly this size), its pages touched
    first by torch's parallel fill, which registers them faster than one thread faulting them in."""

    def __init__(self, nbytes: int, pinned: bool):
        self.nbytes = nbytes
        self.data = torch.empty(nbytes, dtype=torch.uint8)
        self.last_copy = None  # the CUDA event after the last copy into or out of this buffer
        self.pinned = False
        if pinned:
            self.data.zero_()
            error = torch.cuda.cudart().cudaHostRegister(self.data.data_ptr(), nbytes, 0)
            if int(error) != 0:
                raise RuntimeError(f"--offload_activations: pinning {nbytes / 1024**3:.1f} GiB of host memory failed "
                                   f"(CUDA error {int(error)}): the node has less free host memory than the run needs")
            self.pinned = True

    def record_copy(self) -> None:
        """After a copy into or out of the buffer is queued on the current stream (GPU runs)."""
        if self.pinned:
            self.last_copy = torch.cuda.Event()
            self.last_copy.record()

    def order_after_copies(self) -> None:
        """The current stream's next copies wait for the buffer's last one; the host goes on."""
        if self.last_copy is not None:
            torch.cuda.current_stream().wait_event(self.last_copy)

    def unpin(self) -> None:
        """Once its last copy has run (a forward dropped before its backward may leave one in flight)."""
        if self.pinned:
            if self.last_copy is not None:
                self.last_copy.synchronize()
            torch.cuda.cudart().cudaHostUnregister(self.data.data_ptr())
            self.pinned = False

    def __del__(self):  # before its memory returns to the host (a benchmark's next run); at the interpreter's exit
        if not sys.is_finalizing():  # the driver releases it with the process
            self.unpin()


class _Held:
    """One saved tensor in a pooled buffer; its buffer goes back to the pool when autograd drops it."""

    def __init__(self, pool: HostActivations, buffer: _Buffer, host: torch.Tensor, device: torch.device):
        self.pool, self.buffer, self.host, self.device = pool, buffer, host, device

    def back(self) -> torch.Tensor:
        if self.device.type == "cpu":  # a copy: the backward may keep what it returns (a gradient) past its reuse
            return self.host.clone()
        tensor = self.host.to(self.device, non_blocking=self.buffer.pinned)
        self.buffer.record_copy()
        return tensor

    def __del__(self):
        self.pool._give_back(self.buffer)
