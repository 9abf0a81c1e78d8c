"""Checkpoint writes off the critical path, without weakening the complete-only guarantee.

DeepSpeed writes every file of a checkpoint through its checkpoint engine (`engine.checkpoint_engine.save(state,
path)`). `HostCopyWriter` wraps the engine DeepSpeed built: `save` copies the state to host memory (GPU tensors and
CPU-offloaded optimizer states alike, storage sharing kept) and returns; one thread then runs the stock engine's own
`save` on that copy and fsyncs the file. The files are byte-identical to a synchronous save
(tests/distributed/test_background_save.py).

A checkpoint becomes visible only through its manifest and `latest` (checkpoint.save.commit_save), written by rank 0
once every rank reports its writes done. `BackgroundSaves` keeps at most one checkpoint in flight: the ranks agree on
its state in the loop's per-step collective, a new save first finishes the one in flight, and a stop or the last step
finishes before exiting. A crash while a save is in flight leaves the previous checkpoint as `latest`.

DeepSpeed's own decoupled writer was not used: it hands the live tensors to a subprocess and waits for the write at
the next optimizer step, so a save still stalls training for the whole write once it outlasts one step.
"""

from __future__ import annotations

import copy
import os
import queue
import threading
import time

import torch

from model_utils.checkpoint.save import ANOTHER_RANKS_WRITE, commit_everywhere, save_failed, write_failure

IDLE, WRITING, FAILED = 0.0, 1.0, 2.0  # this rank's writer state, agreed across ranks with a MAX all-reduce
RESERVE_AFTER_STEPS = 2  # the saves' host buffers: reserved before the first step, topped up after this many


class HostBuffers:
    """Host storages reused from one save to the next: allocating gigabytes anew each time costs more than the copy
    (its page faults alone take about half a synchronous save: docs/PERFORMANCE.md). Pinned
    where there is a GPU, so that the copies from it run at full speed. `reserve` allocates a save's storages ahead of
    it; `fresh_bytes` counts what `take` had to allocate itself (0 when everything was ready)."""

    def __init__(self, pinned: bool):
        self.pinned = pinned
        self.fresh_bytes = 0
        self._free: dict[int, list] = {}
        self._lock = threading.Lock()

    def _allocate(self, nbytes: int) -> torch.UntypedStorage:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pinned).untyped_storage()

    def take(self, nbytes: int) -> torch.UntypedStorage:
        with self._lock:
            free = self._free.get(nbytes)
            if free:
                return free.pop()
            self.fresh_bytes += nbytes
        return self._allocate(nbytes)

    def give_back(self, storages) -> None:
        with self._lock:
            for storage in storages:
                self._free.setdefault(storage.nbytes(), []).append(storage)

    def reserve(self, sizes) -> None:
        """Have a free storage ready for each of `sizes` (bytes), beyond those already free."""
        with self._lock:
            ready = {n: len(free) for n, free in self._free.items()}
        for nbytes in sizes:
            if ready.get(nbytes, 0):
                ready[nbytes] -= 1
            else:
                self.give_back([self._allocate(nbytes)])


def storage_key(storage) -> tuple:
    """One storage, told apart as torch.save tells them apart (by `_cdata`, its handle: ZeRO-3's empty placeholders all
    have address 0, yet a tied weight's placeholder is one storage); the test of identical bytes fails if that rule
    changes."""
    return ("storage", getattr(storage, "_cdata", (str(storage.device), storage.data_ptr(), storage.nbytes())))


def storage_sizes(obj, seen: set | None = None) -> list[int]:
    """The bytes of each storage host_copy(obj) takes from its buffers: each storage once, by host_copy's rules."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return []
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        storage = obj.untyped_storage()
        key = storage_key(storage)
        sizes = [] if key in seen or not storage.nbytes() else [storage.nbytes()]
        seen.add(key)
        return sizes + [n for value in vars(obj).values() for n in storage_sizes(value, seen)]
    if isinstance(obj, dict):
        return [n for value in obj.values() for n in storage_sizes(value, seen)]
    if type(obj) in (list, tuple):
        return [n for value in obj for n in storage_sizes(value, seen)]
    return []


def host_copy(obj, memo: dict | None = None, buffers: HostBuffers | None = None):
    """`obj` with every tensor copied to host memory (into `buffers`' storages, if given: memo["taken"] lists them;
    copies from a GPU are queued on its stream: synchronize before reading). What `obj` shares stays shared (tensors
    on one storage: tied weights, views of a flat buffer; containers met twice), so torch.save pickles the copy
    exactly as it would `obj`."""
    memo = {"taken": []} if memo is None else memo
    if id(obj) in memo:  # an object met before (a tensor listed twice, two groups' betas): shared in the copy too
        return memo[id(obj)]
    if isinstance(obj, torch.Tensor):
        storage = obj.untyped_storage()
        key = storage_key(storage)  # one storage, one copy
        host_storage = memo.get(key)
        if host_storage is None:
            if buffers is not None and storage.nbytes():
                host_storage = buffers.take(storage.nbytes())
                memo["taken"].append(host_storage)
            else:
                host_storage = torch.UntypedStorage(storage.nbytes())
            host_storage.copy_(storage, non_blocking=True)
            memo[key] = host_storage
        host = torch.empty(0, dtype=obj.dtype).set_(host_storage, obj.storage_offset(), obj.size(), obj.stride())
        if isinstance(obj, torch.nn.Parameter):
            host = torch.nn.Parameter(host, requires_grad=obj.requires_grad)
        else:
            host.requires_grad_(obj.requires_grad)  # ZeRO's fp32 partitions are saved with requires_grad
        memo[id(obj)] = host
        for name, value in vars(obj).items():  # Python attributes torch.save keeps (ZeRO-3's `ds_id`)
            setattr(host, name, host_copy(value, memo, buffers))
        return host
    if isinstance(obj, dict):
        copied = memo[id(obj)] = copy.copy(obj)  # the same type and attributes (a state dict's _metadata)
        for k, v in obj.items():
            copied[k] = host_copy(v, memo, buffers)
        return copied
    if type(obj) is list:
        copied = memo[id(obj)] = []
        copied.extend(host_copy(v, memo, buffers) for v in obj)
        return copied
    if type(obj) is tuple:
        copied = memo[id(obj)] = tuple(host_copy(v, memo, buffers) for v in obj)
        return copied
    return obj  # numbers, strings, dtypes, torch.Size, configs: not changed by training


def moments_to_come(optimizer, state: dict) -> list[int]:
    """The sizes of Adam's two moments of each fp32 partition where ZeRO-3's state holds the partitions and no moments
    yet (torch's Adam makes them at the first update, ZeRO-1/2 at their construction): each the partition's size, so
    that they too are reserved beside the first step's compilation rather than beside later steps, which the pinning
    slows (docs/PERFORMANCE.md, Checkpoint saves)."""
    inner = state.get("optimizer_state_dict")
    if "Adam" not in type(getattr(optimizer, "optimizer", None)).__name__ or not isinstance(inner, dict) \
            or inner.get("state"):
        return []
    return [n for n in storage_sizes(state.get("fp32_flat_groups", [])) for _ in range(2)]


def fsync_path(path: str) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


class HostCopyWriter:
    """Stands in for DeepSpeed's checkpoint engine: `save` returns once the state is in host memory; everything
    else (load, makedirs, create, commit) is the stock engine's."""

    def __init__(self, stock):
        self.stock = stock
        self.jobs: queue.Queue = queue.Queue()
        self.error: str | None = None  # what made a write fail, and its fix (checkpoint.save.write_failure)
        self.fix: str | None = None
        self.buffers = HostBuffers(pinned=torch.cuda.is_available())
        self._reserving: threading.Thread | None = None
        self._thread = threading.Thread(target=self._write_loop, name="checkpoint-writer", daemon=True)
        self._thread.start()

    def __getattr__(self, name):
        return getattr(self.stock, name)

    def reserve(self, engine, save_options: dict) -> int:
        """Allocate, in a thread beside training, the host storages of what this rank's saves hold: the optimizer's
        state and, on the rank that writes the model states, the module's (less the frozen weights a LoRA save leaves
        out). Pinning tens of gigabytes takes seconds (page faults, page locking) that a first save would otherwise
        stand still for; the saves then only copy. Returns the bytes reserved. A size the walk missed is allocated by
        the save as before; engine.save_checkpoint builds its states from these same objects."""
        optimizer_state = engine.optimizer.state_dict()
        states = [optimizer_state]
        if getattr(engine, "save_non_zero_checkpoint", True):
            frozen_left_out = bool(save_options.get("exclude_frozen_parameters"))
            states.append(engine.module_state_dict(exclude_frozen_parameters=frozen_left_out))
        sizes = storage_sizes(states) + moments_to_come(engine.optimizer, optimizer_state)
        del states, optimizer_state
        device = torch.cuda.current_device() if torch.cuda.is_available() else None
        self._reserving = threading.Thread(target=self._reserve, args=(sizes, device, self._reserving),
                                           name="checkpoint-buffers", daemon=True)
        self._reserving.start()
        return sum(sizes)

    def _reserve(self, sizes: list[int], device: int | None, before: threading.Thread | None) -> None:
        if before is not None:  # an earlier reservation: what it holds counts
            before.join()
        if device is not None:  # this rank's GPU, not the thread's default (GPU 0), pins the memory
            torch.cuda.set_device(device)
        self.buffers.reserve(sizes)

    def save(self, state_dict, path: str):
        if self._reserving is not None:  # the buffers being reserved are this save's: take them, not new ones
            self._reserving.join()
        memo = {"taken": []}
        state_copy = host_copy(state_dict, memo, self.buffers)
        if torch.cuda.is_available():
            torch.cuda.current_stream().synchronize()  # the copies from the GPU have landed
        self.jobs.put((self.stock.save, state_copy, path, memo["taken"]))

    def save_file(self, obj, path: str):
        """A file of ours (the rank's RNG state), written in order with DeepSpeed's."""
        self.jobs.put((torch.save, host_copy(obj), path, []))

    def _write_loop(self):
        while True:
            write, obj, path, taken = self.jobs.get()
            try:
                if self.error is None:  # after a failure the checkpoint is lost anyway: drop the rest
                    write(obj, str(path))
                    fsync_path(str(path))
            except (OSError, RuntimeError) as e:  # disk full, quota, permissions, a read-only or vanished directory

                self.error, self.fix = write_failure(e, path)
            finally:
                del obj
                self.buffers.give_back(taken)
                self.jobs.task_done()

    def state(self) -> float:
        if self.error is not None:
            return FAILED
        return WRITING if self.jobs.unfinished_tasks else IDLE

    def wait(self) -> None:
        self.jobs.join()


def install(engine, log) -> HostCopyWriter | None:
    """Wrap the engine's checkpoint engine, if it is DeepSpeed's plain torch.save engine (a configured writer,
    e.g. FastPersist's `checkpoint.writer`, is kept as the user chose it)."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    stock = engine.checkpoint_engine
    if type(stock) is not TorchCheckpointEngine:
        log(f"checkpoint: written synchronously by the configured {type(stock).__name__}")
        return None
    engine.checkpoint_engine = HostCopyWriter(stock)
    return engine.checkpoint_engine


class BackgroundSaves:
    """At most one checkpoint in flight; it is committed (manifest, `latest`) once all ranks have written it."""

    def __init__(self, writer: HostCopyWriter, dist, log, metrics=None):
        self.writer, self.dist, self.log = writer, dist, log
        self.metrics = metrics or (lambda record: None)  # the run's metrics.jsonl (rank 0 writes)
        self.pending = None  # the checkpoint.save.PendingSave in flight
        self.last_write_s: float | None = None  # how long the last committed checkpoint took from start to complete
        self.steps_seen = 0
        self.reserving = True  # False once the optimizer's state could not be read ahead

    def reserve_buffers(self, engine, save_options: dict) -> None:
        """Called before every step: before the first, reserves the saves' host buffers (HostCopyWriter.reserve) beside
        it (its compilation leaves the CPUs room; DeepSpeed's ZeRO optimizers hold their fp32 partitions from the start,
        and ZeRO-3's Adam moments to come are counted ahead), and before the step after RESERVE_AFTER_STEPS, what the
        first updates added (a delayed update makes its first during the second step) and the first did not hold."""
        if self.reserving and self.steps_seen in (0, RESERVE_AFTER_STEPS):
            try:
                nbytes = self.writer.reserve(engine, save_options)
            except (RuntimeError, NotImplementedError, AttributeError, KeyError, TypeError) as e:  # a state that
                # cannot be read between steps: its saves allocate their host memory themselves, as before
                self.reserving = False
                self.log(f"checkpoint: host memory for the saves not reserved ahead ({type(e).__name__}: {e}); each "
                         "save allocates what it lacks")
            else:
                if not self.steps_seen:
                    self.log(f"checkpoint: reserving {nbytes / 2**30:.1f} GiB of "
                             f"{'pinned ' * self.writer.buffers.pinned}host memory for this rank's saves, beside "
                             "training (a save then only copies into it)")
        self.steps_seen += 1

    def local_state(self) -> float:
        return self.writer.state() if self.pending is not None else IDLE

    def agreed(self, state: float) -> None:
        """Called on every rank with the MAX over ranks of local_state(), from the same collective."""
        if self.pending is None:
            return
        if state == FAILED:
            self._fail()
        if state == IDLE:
            self._commit()

    def finish(self) -> None:
        """Wait for the checkpoint in flight and commit it (every rank calls this at the same point)."""
        if self.pending is None:
            return
        self.writer.wait()
        flag = torch.tensor([self.writer.state()], device=self.dist.device)
        self.dist.all_reduce(flag, torch.distributed.ReduceOp.MAX)
        if flag.item() == FAILED:
            self._fail()
        self._commit()

    def started(self, pending) -> None:
        self.pending = pending

    def _commit(self):
        pending, self.pending = self.pending, None
        commit_everywhere(pending, self.dist, self.log)
        self.last_write_s = time.perf_counter() - pending.started
        self.log(f"checkpoint: {pending.path.name} complete, written in the background in {self.last_write_s:.1f}s")
        self.metrics({"step": pending.step, "checkpoint_write_s": self.last_write_s})

    def _fail(self):
        cause, fix = (self.writer.error, self.writer.fix) if self.writer.error else ANOTHER_RANKS_WRITE
        raise save_failed(self.pending.path.name, cause, fix)
