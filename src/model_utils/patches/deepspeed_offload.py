"""ZeRO with the optimizer offloaded to the CPU: the one-step delayed parameter update (--delayed_update_from_step).

DeepSpeed's offload step runs on the host while the GPU waits: the gradient clip, DeepSpeedCPUAdam over the fp32
master weights, their conversion to bf16 and the copy back (docs/PERFORMANCE.md, Where an offload step goes, times
it). ZeRO-Offload's delayed parameter update (Ren et al., 2021) moves that work beside the next
step's forward and backward: the update of step t runs in a background thread while step t+1 computes its gradients on
the weights before that update, and lands in the model at step t+1's boundary. What changes: from the given step on,
each step's gradients are taken at the weights of one step earlier (the update applied is AdamW's, unchanged).
ZeRO-1/2 (DelayedUpdate) and ZeRO-3 (DelayedUpdateZero3) each have their own step to replace. Under ZeRO-1/2 the
thread also copies the new 16-bit weights to a GPU buffer of its own once its update is done (the prefetch), so that
the boundary's copy of them stays within the GPU.

The thread steps DeepSpeedCPUAdam's own state (step count, moments) with torch's fused CPU AdamW, whose kernel releases
Python's GIL (DeepSpeed's op holds it for the whole update, which starves the GPU of kernel launches beside it:
`benchmarks/offload_step.py` measures it). The update in flight is applied (`settle`) before
anything reads the weights outside training: checkpoints, evaluations, the export. Those steps are fixed by the run's
settings, so a run resumed from a checkpoint continues exactly as the run that wrote it.
"""

from __future__ import annotations

import threading

from model_utils.patches import Patch, gate

DELAYED_UPDATE = Patch(
    "deepspeed", "0.19.8", "0.19.8",
    "DeepSpeedZeroOptimizer.step (replaced on the instance for CPU offload: its norm, skip and all-gather kept, the "
    "update deferred to a thread, which also copies the new 16-bit partition to a GPU buffer of its own) and "
    ".scale_if_loss (waits for the update in flight before the boundary backward "
    "copies gradients to the host); DeepSpeedCPUAdam's state stepped by torch's fused AdamW",
    "the host update of each step runs beside the next step's GPU work (docs/PERFORMANCE.md, Big models with CPU "
    "offload)",

    ("tests/distributed/test_delayed_update.py::test_delayed_update_equals_deepspeed_with_gradients_one_step_late",
     "tests/distributed/test_delayed_update.py::test_a_delayed_update_run_resumes_exactly",
     "tests/distributed/test_delayed_update.py::test_the_prefetch_to_the_gpu_changes_no_weight"))

DELAYED_UPDATE_ZERO3 = Patch(
    "deepspeed", "0.19.8", "0.19.8",
    "DeepSpeedZeroOptimizer_Stage3.step (replaced on the instance for CPU offload: its norm, skip, clip and "
    "partition bookkeeping kept, the host update deferred to a thread, the 16-bit partitions rewritten from the fp32 "
    "master weights at the next step) and .scale_if_loss (waits for the update in flight before the boundary backward "
    "copies gradients to the host); DeepSpeedCPUAdam's state stepped by torch's fused AdamW",
    "the host's clip and AdamW run beside the next step's GPU work (docs/PERFORMANCE.md, ZeRO-3 with parameters and "
    "optimizer offloaded)",

    ("tests/distributed/test_delayed_update.py::test_delayed_update_equals_deepspeed_with_gradients_one_step_late",
     "tests/distributed/test_delayed_update.py::test_a_partial_zero3_offload_delays_its_gpu_part_alike",
     "tests/distributed/test_delayed_update.py::test_a_delayed_update_run_resumes_exactly",
     "tests/distributed/test_delayed_update.py::test_a_process_ending_with_an_update_in_flight_exits_cleanly"))


def delay_offload_updates(engine, from_step: int, log, prefetch: bool = True) -> bool:
    """Install the delayed update on a ZeRO engine with CPU optimizer offload, from optimizer step `from_step` on (0:
    off); `prefetch` (ZeRO-1/2 on GPUs: --delayed_update_prefetch) copies each update's 16-bit weights to a second GPU
    buffer as soon as the host has them. Returns whether it is in force; the checks of
    config.deepspeed.check_delayed_update have refused the configs it does not cover before the engine was built, so
    here only an untested DeepSpeed release takes the stock step."""
    if from_step <= 0:
        return False
    zero3 = hasattr(getattr(engine, "optimizer", None), "fp32_partitioned_groups_flat")
    if not gate(DELAYED_UPDATE_ZERO3 if zero3 else DELAYED_UPDATE, log):
        log(f"offload: --delayed_update_from_step {from_step} not applied (each step's update before the next step)")
        return False
    delayed = DelayedUpdateZero3(engine, from_step) if zero3 else DelayedUpdate(engine, from_step, prefetch)
    delayed.install()
    log(f"offload: from step {from_step} on, each step's CPU optimizer update runs beside the next step's forward and "
        "backward, which take their gradients at the weights before it (the one-step delayed parameter update)"
        + ("; its 16-bit weights go to a second GPU buffer as soon as they are ready, and the step's boundary copies "
           "them from there" if getattr(delayed, "staged", None) else ""))
    return True


def settle(engine) -> None:
    """Apply the update in flight, if any, so that the model holds every step's update (before a checkpoint, an
    evaluation or the export)."""
    delayed = getattr(engine.optimizer, "dslm_delayed_update", None)
    if delayed is not None:
        delayed.apply_pending()


class _DelayedStep:
    """What the delayed step shares between ZeRO stages: the thread that runs the host update, the wait for it before
    the boundary backward rewrites the gradients it reads, and DeepSpeed's clip as one host scalar."""

    def __init__(self, engine, from_step: int, cpu_partitions: list):
        import torch

        self.engine, self.opt, self.from_step = engine, engine.optimizer, from_step
        self.cpu_adam = self.opt.optimizer  # DeepSpeedCPUAdam: its param_groups and state are the ones checkpointed
        self.thread: threading.Thread | None = None
        self.error: Exception | None = None
        self.pending = False  # an update computed (or computing) on the host that the model has not received
        self.copied = None  # CUDA event: the GPU has read the host's bf16 buffers (they may be rewritten after it)
        self.stock_step = self.opt.step
        # One torch AdamW per host partition (ZeRO-1/2: parameter group; ZeRO-3: sub-group): its fused CPU kernel does
        # the update.
        self.adams = {id(partition): torch.optim.AdamW([partition], fused=True) for partition in cpu_partitions}

    def install(self) -> None:
        opt = self.opt
        opt.dslm_delayed_update = self
        stock_scale_if_loss = opt.scale_if_loss

        def scale_if_loss(value):
            # engine.backward calls this first; the boundary's backward copies the gradients into the host buffers
            # the update in flight reads, so it waits for that update (usually long done) to finish.
            if self.engine.is_gradient_accumulation_boundary():
                self.join()
            return stock_scale_if_loss(value)

        opt.scale_if_loss = scale_if_loss
        opt.step = self.step

    def step(self, closure=None):
        raise NotImplementedError

    def apply_pending(self) -> None:
        raise NotImplementedError

    # ----- the thread -----
    def join(self) -> None:
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        if self.error is not None:
            error, self.error = self.error, None
            raise RuntimeError("the delayed optimizer update failed on the host") from error

    def _queue(self, partition, group: dict, inverse_scale, bit16_buffer=None) -> tuple:
        """One host partition's share of the update: DeepSpeedCPUAdam's state for it (created in its own layout, so
        its checkpoints and hp-param links hold it) lent to the torch AdamW that steps it, its step count advanced."""
        import torch

        state = self.cpu_adam.state[partition]
        if not state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(partition.data, dtype=torch.float32)
            state["exp_avg_sq"] = torch.zeros_like(partition.data, dtype=torch.float32)
        adam = self.adams[id(partition)]
        adam.state[partition] = {"step": torch.tensor(float(state["step"]), dtype=torch.float32),
                                 "exp_avg": state["exp_avg"], "exp_avg_sq": state["exp_avg_sq"]}
        state["step"] += 1
        hyper = {"lr": group["lr"], "betas": tuple(group["betas"]), "eps": group["eps"],
                 "weight_decay": group["weight_decay"]}
        return adam, partition, bit16_buffer, inverse_scale, hyper

    def _start(self, work: list) -> None:
        self.pending = True
        # Not a daemon: a process that ends with an update in flight (an error, a benchmark's last step) waits for it
        # at exit; a daemon thread inside a torch kernel when the interpreter finalises aborts the process (SIGABRT).
        self.thread = threading.Thread(target=self._update, args=(work,), name="delayed-optimizer-update", daemon=False)
        self.thread.start()

    def _update(self, work: list) -> None:
        try:
            if self.copied is not None:
                self.copied.synchronize()  # the bf16 buffers are on their way to the GPU: wait before rewriting them
            for adam, partition, bit16_buffer, inverse_scale, hyper in work:
                if inverse_scale is not None:
                    partition.grad.mul_(inverse_scale)  # DeepSpeed's unscale_and_clip_grads, same operation
                adam.param_groups[0].update(hyper)
                adam.step()
                if bit16_buffer is not None:
                    bit16_buffer.copy_(partition)
            self._after_update()
        except Exception as error:  # re-raised in the training thread by join()
            self.error = error

    def _after_update(self) -> None:
        """The thread's last part, after every partition's update (DelayedUpdate: the prefetch to the GPU)."""

    def _inverse_clip_scale(self, norm):
        """1 / the combined scale of DeepSpeed's unscale_and_clip_grads, as a host scalar tensor (None: no scaling)."""
        import torch
        from deepspeed.runtime.utils import is_invalid_grad_norm

        opt = self.opt
        if opt.clip_grad == 0.0 and opt.loss_scale == 1.0:
            return None
        combined = opt.loss_scale
        if opt.clip_grad > 0.0:
            if is_invalid_grad_norm(norm):  # a non-finite norm that did not skip the step (bf16): scale by 1/inf
                norm = torch.tensor(float("inf"), dtype=torch.float, device=norm.device)
            clip = ((norm / opt.loss_scale) + 1e-6) / opt.clip_grad
            combined = torch.clamp(clip, min=1.0) * opt.loss_scale
        inverse = 1.0 / combined
        return inverse.cpu() if torch.is_tensor(inverse) else torch.tensor(inverse, dtype=torch.float32)


class DelayedUpdate(_DelayedStep):
    """The delayed step on one ZeRO-1/2 optimizer (DeepSpeedZeroOptimizer with cpu_offload, bf16 or fp32)."""

    def __init__(self, engine, from_step: int, prefetch: bool = True):
        import torch

        super().__init__(engine, from_step, engine.optimizer.single_partition_of_fp32_groups)
        opt = engine.optimizer
        own = [opt.parallel_partitioned_bit16_groups[i][self._partition_id(i)]
               for i in range(len(opt.bit16_groups))]
        # The prefetch: a GPU copy of the rank's 16-bit partitions that the thread fills from the host buffers on a
        # stream of its own as soon as its update is done, so that the boundary copies the new weights within the GPU
        # instead of over PCIe, which the next forward waits for (docs/PERFORMANCE.md, the delayed update's prefetch).
        self.staged = [torch.empty_like(p) for p in own] if prefetch and own and own[0].is_cuda else None
        self.stream = torch.cuda.Stream(device=own[0].device) if self.staged else None
        self.consumed = None  # CUDA event: the boundary's copy has read the staged buffers (they may be refilled)

    def _partition_id(self, group: int) -> int:
        from deepspeed import comm as dist

        return dist.get_rank(group=self.opt.real_dp_process_group[group])

    def _after_update(self) -> None:
        import torch

        if not self.staged:
            return
        with torch.cuda.stream(self.stream):
            if self.consumed is not None:
                self.stream.wait_event(self.consumed)
            for staged, bit16_buffer in zip(self.staged, self.opt.param_buffer_of_bit16_for_cpu_offload_groups):
                staged.copy_(bit16_buffer, non_blocking=True)
        # Done before join() returns: the boundary then reads the staged buffers, and the next update may rewrite the
        # host buffers they came from.
        self.stream.synchronize()

    # ----- DeepSpeedZeroOptimizer.step, delayed -----
    def step(self, closure=None):
        import torch
        from deepspeed.runtime.zero.stage_1_and_2 import INITIAL_MICRO_STEP_ID, is_invalid_grad_norm

        if self.engine.global_steps + 1 < self.from_step:
            return self.stock_step(closure)
        opt = self.opt
        opt.micro_step_id = INITIAL_MICRO_STEP_ID
        opt._wait_for_offload_copies()
        opt._offload_accumulated_param_ids = set()
        self.apply_pending()  # the previous step's update, computed beside this step's micro-batches

        # The norm, the clip and the skip of a non-finite gradient, as DeepSpeed's step.
        opt.overflow = False
        if opt.check_grad_overflow:
            opt.check_overflow(partition_gradients=opt.partition_gradients)
        norm = None
        if opt.compute_grad_norm and not opt.overflow:
            norm = opt.scaled_global_norm()
            if (opt.dtype != torch.bfloat16 or opt.check_grad_overflow) and is_invalid_grad_norm(norm):
                opt.overflow = True
        prev_scale = opt.loss_scale
        opt._update_scale(opt.overflow)
        if opt.overflow:
            if opt.compute_grad_norm:
                opt._global_grad_norm = float("inf")
            opt.zero_grad(set_to_none=True)
            opt._release_preflattened_grad_buffers()
            opt.reset_cpu_buffers()
            return
        if norm is not None:
            opt._global_grad_norm = norm / prev_scale

        inverse_scale = self._inverse_clip_scale(norm)
        work = []
        for i, partition in enumerate(opt.single_partition_of_fp32_groups):
            work.append(self._queue(partition, self.cpu_adam.param_groups[i], inverse_scale,
                                    opt.param_buffer_of_bit16_for_cpu_offload_groups[i]))
            opt._release_preflattened_grad_buffers(i)
            opt.averaged_gradients[i] = None
        opt._lazy_init_hp_params_optimizer_state()
        opt.reset_cpu_buffers()
        self._start(work)

    def apply_pending(self) -> None:
        """Wait for the update in flight and put its weights on the GPU: the bf16 partition copied up (from the
        prefetch's GPU buffer where there is one), all-gathered over the data-parallel ranks, the model's parameters
        pointed at it (DeepSpeed's step, after its update)."""
        import torch
        from deepspeed.runtime.utils import all_gather_dp_groups

        self.join()
        if not self.pending:
            return
        opt = self.opt
        sources = self.staged or opt.param_buffer_of_bit16_for_cpu_offload_groups
        for i, source in enumerate(sources):
            opt.parallel_partitioned_bit16_groups[i][self._partition_id(i)].data.copy_(source.data, non_blocking=True)
        if self.staged:
            self.consumed = torch.cuda.Event()
            self.consumed.record()
        elif torch.cuda.is_available() and opt.parallel_partitioned_bit16_groups[0][0].is_cuda:
            self.copied = torch.cuda.Event()
            self.copied.record()
        all_gather_dp_groups(groups_flat=opt.bit16_groups_flat,
                             partitioned_param_groups=opt.parallel_partitioned_bit16_groups,
                             dp_process_group=opt.real_dp_process_group,
                             start_alignment_factor=opt.nccl_start_alignment_factor,
                             allgather_bucket_size=opt.allgather_bucket_size)
        for i in range(len(opt.bit16_groups)):
            opt._update_model_bit16_weights(i)
        self.pending = False


class DelayedUpdateZero3(_DelayedStep):
    """The delayed step on one ZeRO-3 optimizer (DeepSpeedZeroOptimizer_Stage3) with the optimizer offloaded, fully or
    in part, the parameters offloaded or not.

    Under ZeRO-3 the 16-bit partitions the forward fetches its parameters from are the ones DeepSpeed's step rewrites
    from the fp32 master weights, so the thread updates the master weights and the Adam moments only, and the next
    step rewrites the 16-bit partitions from them (apply_pending, timed in docs/PERFORMANCE.md). The
    sub-groups a partial offload keeps on the GPU take DeepSpeed's own AdamW there at once; their 16-bit partitions
    wait for the next step too, so every weight is one step late alike."""

    def __init__(self, engine, from_step: int):
        opt = engine.optimizer
        cpu = [flat for i, flat in enumerate(opt.fp32_partitioned_groups_flat) if self._on_host(opt, i)]
        super().__init__(engine, from_step, cpu)

    @staticmethod
    def _on_host(opt, sub_group: int) -> bool:
        return getattr(opt, "subgroup_to_device", {}).get(sub_group, "cpu") == "cpu"

    # ----- DeepSpeedZeroOptimizer_Stage3.step, delayed -----
    def step(self, closure=None):
        from deepspeed.runtime.utils import combine_grad_norm_groups, is_invalid_grad_norm

        if self.engine.global_steps + 1 < self.from_step:
            return self.stock_step(closure)
        opt = self.opt
        opt._pre_step()
        opt._partition_all_parameters()

        # The norm and the skip of a non-finite gradient, as DeepSpeed's step. The norm's read to the host also
        # waits for the GPU's last reads of the 16-bit partitions, which apply_pending rewrites.
        opt._overflow_check_and_loss_scale_update(update_scale=False)
        norm = None
        if not opt.overflow:
            norm = combine_grad_norm_groups(opt._get_norm_groups())
            if is_invalid_grad_norm(norm):
                opt.overflow = True
        self.apply_pending()  # the previous step's update, computed beside this step's micro-batches
        if opt._loss_scale_update_and_overflow_cleanup():
            return
        opt._global_grad_norm = norm / opt.loss_scale

        inverse_scale = self._inverse_clip_scale(norm)
        work = []
        for i, partition in enumerate(opt.fp32_partitioned_groups_flat):
            if not self._on_host(opt, i):  # a partial offload's GPU part: DeepSpeed's AdamW there, now
                opt.unscale_and_clip_grads(i, norm)
                opt._optimizer_step(i)
                continue
            work.append(self._queue(partition, self.cpu_adam.param_groups[opt.sub_group_to_group_id[i]],
                                    inverse_scale))
        opt.reset_cpu_buffers()
        self._start(work)
        self._gather_persistent()  # as DeepSpeed's step ends: the small parameters ZeRO-3 keeps whole on the GPU

    def _gather_persistent(self) -> None:
        persistent = self.opt.persistent_parameters
        if persistent:
            persistent[0].partition(persistent)  # those already whole are gathered again only once released
            persistent[0].all_gather(persistent)

    def apply_pending(self) -> None:
        """Wait for the update in flight and hand its weights to the model: every sub-group's 16-bit partition
        rewritten from its fp32 master weights, the persistent parameters gathered again (DeepSpeed's step, after its
        update)."""
        self.join()
        if not self.pending:
            return
        opt = self.opt
        for i in range(len(opt.fp16_groups)):
            opt._reassign_or_swap_out_partitioned_parameters(i)
        self._gather_persistent()
        opt.invalidate_secondary_tensor()
        self.pending = False
