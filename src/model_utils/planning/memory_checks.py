"""The preflight's memory checks: the estimate against the GPU and the node's host memory, and where a run does not fit
or runs slower than it could, the cheapest alternative that fits (a partial offload, ZeRO-2, whole ZeRO-3 parameters,
checkpointed layers with a larger micro-batch), each named with the settings that take it.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
from typing import TYPE_CHECKING

from model_utils.config import deepspeed as dsc
from model_utils.core.problems import Problem
from model_utils.core.repo import REPO_ROOT
from model_utils.models import speed
from model_utils.models.memory import AUTO_MEMORY_SHARE, GIB, activation_bytes, cheapest_fit
from model_utils.models.quantization import BYTES_PER_PARAM
from model_utils.models.sequence_parallel import sequence_parallel_problems
from model_utils.planning.report import Report

if TYPE_CHECKING:  # annotations only
    from model_utils.planning.plan import Plan


def check_host_memory(plan: Plan, report: Report) -> None:
    """Offloaded states live in the node's memory: a node without room for them would be killed minutes into setup."""
    check_activation_host_memory(plan, report)
    if not plan.memory.host_bytes:
        return
    need, available = plan.memory.host_bytes / GIB, plan.hardware.host_available
    loading = plan.memory.host_bytes + plan.memory.resume_host_bytes
    report.estimate(f"host memory: ~{need:.0f} GiB per node for the offloaded states of {plan.hardware.ranks_per_node} rank(s)"
                    + (f", ~{loading / GIB:.0f} GiB while a resume loads a checkpoint" if plan.memory.resume_host_bytes else "")
                    + (f"; {available / GIB:.0f} GiB available" if available is not None else
                       " (the GPU nodes' memory is checked when the run starts there)"))
    if available is not None and plan.memory.host_bytes <= available < loading:
        if plan.resume is not None:  # the kernel would kill the ranks while they load, with no message of ours
            cfg = plan.cfg
            setting, value = (("--resume_from_checkpoint", cfg.checkpoint.resume_from_checkpoint) if cfg.checkpoint.resume_from_checkpoint
                              else ("--resume", cfg.checkpoint.resume))
            report.problems.append(Problem(
                setting, value,
                f"loading {plan.resume.path.name} needs ~{loading / GIB:.0f} GiB of host memory on this node beside "
                f"the offloaded states, {available / GIB:.0f} GiB are available",
                "resume on nodes with more memory, or on more of them (the states divide among the ranks); the "
                "checkpoint is intact"))
        else:
            report.notes.append(
                f"this node holds the offloaded states (~{need:.0f} GiB of {available / GIB:.0f}) but not a resume "
                f"of their checkpoint (~{loading / GIB:.0f} GiB while it loads): resume on nodes with more memory")
    if available is not None and plan.memory.host_bytes > available:
        partial = partial_offload_that_fits(plan, available)
        report.problems.append(Problem(
            "zero_optimization.offload_optimizer / offload_param", f"{plan.model.num_params / 1e9:.1f}B parameters",
            f"the offloaded states need ~{need:.0f} GiB of host memory on this node, {available / GIB:.0f} GiB are "
            "available",
            ("keep part of the optimizer on the GPU: configs/zero3-offload.json with "
             + ("\"offload_param\": {\"device\": \"none\"} and " if partial[1] == "none" else "")
             + f"\"offload_optimizer\": {{\"ratio\": {partial[0]:g}}} (~{partial[2] / GIB:.0f} GiB host, "
             f"~{partial[3] / GIB:.0f} GiB GPU at micro-batch 1 by the estimate; not measured on GPUs), or "
             if partial else "")
            + "use more GPUs or nodes (ZeRO divides the offloaded states among the ranks), a node with more memory, "
            "or ZeRO-3 without offload on enough GPUs to hold the model states"))


def check_activation_host_memory(plan: Plan, report: Report) -> None:
    """--offload_activations: the recomputed layers' inputs of every rank of a node, in its pinned memory beside the
    offloaded states; a node without room would be killed in the first forward pass."""
    need = plan.memory.activation_host_bytes
    if not need:
        return
    available = plan.hardware.host_available
    report.estimate(f"host memory: ~{need / GIB:.1f} GiB per node for the offloaded layer inputs of "
                    f"{plan.hardware.ranks_per_node} rank(s) (--offload_activations)"
                    + (f"; {available / GIB:.0f} GiB available" if available is not None else ""))
    room = host_room(plan)
    if room is not None and need > room:
        report.problems.append(Problem(
            "--offload_activations", True, f"the layers' inputs need ~{need / GIB:.0f} GiB of host memory per node "
            f"beside ~{plan.memory.host_bytes / GIB:.0f} GiB of offloaded states, {available / GIB:.0f} GiB are "
            "available", "split each sequence over more GPUs (--sequence_parallel) or keep the inputs on the GPUs "
            "(leave out --offload_activations)"))


LONG_SEQUENCE = 16384  # from this --seq_len (or with --sequence_parallel) the preflight says the longest that fits


def _sized(plan: Plan) -> bool:
    """Whether the plan has what sizing a sequence needs: a memory model with a GPU budget, a config, the estimate."""
    return not (plan.memory_model is None or plan.memory_model.budget is None or plan.ds_config is None
                or plan.memory is None)


def note_long_sequences(plan: Plan, report: Report) -> None:
    """Long or split sequences: the longest sequence these settings fit on these GPUs by the estimate, and where the
    run's sequences do not fit, the fewest GPUs per sequence (--sequence_parallel) that would fit them."""
    if not _sized(plan) or (plan.sequence_parallel == 1 and plan.seq_len < LONG_SEQUENCE):
        return
    split = plan.sequence_parallel
    longest = longest_sequence(plan, split)
    settings = ", ".join([f"--sequence_parallel {split}"]
                         + (["--gradient_checkpointing"] if plan.memory.checkpointed_layers else [])
                         + (["--offload_activations"] if plan.cfg.model.offload_activations else []))
    host = offloads_inputs(plan) and host_room(plan) is not None
    report.estimate(f"long sequences: the longest that fits is ~{longest:,} tokens per sequence at micro-batch 1 "
                    f"({settings}; {plan.hardware.gpu_memory_gib:.0f} GiB GPUs"
                    + (f", {plan.hardware.host_available / GIB:.0f} GiB of host memory free" if host else "")
                    + ", by the estimate)")


def split_that_fits(plan: Plan) -> int | None:
    """The fewest GPUs of a node per sequence (--sequence_parallel, more than the plan's) with which the plan's
    sequences fit at micro-batch 1 by the estimate; None where none does or nothing is known."""
    if not _sized(plan):
        return None
    gpus = plan.hardware.ranks_per_node
    for n in range(plan.sequence_parallel + 1, gpus + 1):
        if not sequence_parallel_problems(plan.model.config, n, plan.seq_len, gpus, plan.cfg.model.attn_implementation):
            if longest_sequence(plan, n) >= plan.seq_len:
                return n
    return None


NODE_SIZES = (2, 4, 8)  # GPUs per node that clusters have; Ulysses splits a sequence within one node


def split_on_a_larger_node(plan: Plan) -> tuple[int, float] | None:
    """Where no split of this node's GPUs fits the plan's sequences: the fewest GPUs of a larger node (NODE_SIZES)
    that, each sequence split across them at micro-batch 1, fit it on GPUs of this size by the estimate, with the host
    memory such a node's offloaded layer inputs take (0 without --offload_activations); None where none does."""
    if not _sized(plan) or plan.batch.micro != 1:
        return None
    for n in NODE_SIZES:
        if n <= plan.hardware.ranks_per_node or sequence_parallel_problems(
                plan.model.config, n, plan.seq_len, n, plan.cfg.model.attn_implementation):
            continue
        if train_fits(plan, seq_len=plan.seq_len // n):
            return n, offloaded_inputs_bytes(plan, plan.seq_len // n, ranks=n) if offloads_inputs(plan) else 0.0
    return None


def offloads_inputs(plan: Plan) -> bool:
    """Whether the recomputed layers' inputs go to host memory (--offload_activations, and layers that recompute)."""
    return bool(plan.cfg.model.offload_activations and plan.memory.checkpointed_layers)


def train_fits(plan: Plan, **changes) -> bool:
    """Whether the training step at micro-batch 1 fits the GPU budget by the memory model, with `changes` to it
    (seq_len: the tokens on each GPU; offload_activations)."""
    model = dataclasses.replace(plan.memory_model, **changes)
    return model.phases(plan.ds_config, 1, plan.memory.checkpointed_layers).train <= plan.memory_model.budget


def host_room(plan: Plan) -> float | None:
    """The host memory a node's offloaded layer inputs may take: HOST_MEMORY_SHARE of what is free, less the offloaded
    states; None where the free memory is not known (a login node)."""
    available = plan.hardware.host_available
    return None if available is None else HOST_MEMORY_SHARE * available - plan.memory.host_bytes


def offloaded_inputs_bytes(plan: Plan, rank_tokens: int, ranks: int | None = None) -> float:
    """A node's offloaded layer inputs at micro-batch 1 with `rank_tokens` tokens on each of its `ranks` GPUs (None:
    this node's), Plan.offloaded_bytes for each."""
    ranks = ranks or plan.hardware.ranks_per_node
    return ranks * plan.offloaded_bytes(rank_tokens, 1, plan.memory.checkpointed_layers)


def longest_sequence(plan: Plan, split: int) -> int:
    """The longest sequence (a multiple of split x 1,024 tokens) whose training step at micro-batch 1 fits the GPU
    budget by the memory model, each GPU holding 1/split of it, and, with --offload_activations, whose layer inputs
    fit the node's free host memory; 0 where none does."""
    step = split * 1024
    room = host_room(plan) if offloads_inputs(plan) else None

    def fits(tokens: int) -> bool:
        if room is not None and offloaded_inputs_bytes(plan, tokens // split) > room:
            return False
        return train_fits(plan, seq_len=tokens // split)

    low, high = 0, 1 << 15  # in steps: up to 32M x split tokens
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if fits(middle * step) else (low, middle - 1)
    return low * step


def note_offload_accumulation(plan: Plan, report: Report) -> None:
    """ZeRO-1/2 with the optimizer offloaded and gradient accumulation: unless gradients accumulate in DeepSpeed's fp32
    buffer on the GPU, each micro-batch's gradients go to the CPU and back (the seeds' configs do this)."""
    ds = plan.ds_config
    if not (dsc.zero12_optimizer_offload(ds) and dsc.precision(ds) != "fp32"
            and plan.batch.accumulation > 1 and not dsc.fp32_grad_accumulation(ds)):
        return
    extra = 4 * plan.model.num_params / plan.world
    budget = AUTO_MEMORY_SHARE * plan.hardware.gpu_memory_gib * GIB if plan.hardware.gpu_memory_gib else None
    room = ("" if budget is None else ", which fits beside this run" if plan.memory.phases.peak[1] + extra <= budget
            else ", more than this micro-batch leaves (with \"auto\" the micro-batch makes room)")
    report.notes.append(
        f"with the optimizer offloaded, DeepSpeed sends each of the {plan.batch.accumulation} micro-batches' gradients "
        "to the CPU and back: \"data_types\": {\"grad_accum_dtype\": \"fp32\"} accumulates them on the GPU and copies "
        "them once per step (configs/zero2-offload.json has it; docs/PERFORMANCE.md gives the gain), for "
        f"~{extra / GIB:.1f} GiB more per GPU{room}")


def note_parameter_fetches(plan: Plan, report: Report) -> None:
    """ZeRO-3 with the parameters offloaded fetches all of them from host memory for every micro-batch's forward and
    again for its backward, so a step's micro-batches multiply that traffic: a given micro-batch smaller than the
    largest that fits, or a run without activation checkpointing, under which a larger one would fit."""
    ds, batch = plan.ds_config, plan.batch
    if not (dsc.zero_stage(ds) == 3 and dsc.offloads(ds)[1] and batch.accumulation > 1):
        return
    per_rank = batch.micro * batch.accumulation
    best = None if plan.micro_batch_choice else automatic_micro_batch(plan)  # "auto" already took the largest
    if best is not None and best > batch.micro:
        fetched = 2 * 2 * plan.model.num_params / plan.world  # 16-bit parameters, forward and backward
        report.notes.append(
            f"ZeRO-3 with the parameters offloaded fetches all of them from host memory for each micro-batch's forward "
            f"and backward (~{fetched / GIB:.0f} GiB per rank), {batch.accumulation} times per step at micro-batch "
            f"{batch.micro}: micro-batch {best} (x {per_rank // best}) fits by the estimate and fetches them "
            f"{per_rank // best} times (--micro_batch_size auto; docs/PERFORMANCE.md measures the difference)")
    checkpointed = checkpointed_micro_that_fits(plan)
    if checkpointed is not None:
        micro, gpu = checkpointed
        report.notes.append(
            f"with --gradient_checkpointing, micro-batch {micro} (x {per_rank // micro}) fits by the estimate "
            f"(~{gpu / GIB:.1f} GiB) and fetches the offloaded parameters {per_rank // micro} times per step instead of "
            f"{batch.accumulation}, for a third more forward compute, less with --checkpointed_layers auto, which "
            "recomputes only the layers the GPU needs (docs/PERFORMANCE.md measures both)")


def note_parameters_fit_on_the_gpu(plan: Plan, report: Report) -> None:
    """ZeRO-3 with the parameters offloaded where they fit on the GPUs beside ZeRO-2's states: ZeRO-2 with only the
    optimizer offloaded fetches nothing from host memory."""
    ds = plan.ds_config
    if not (dsc.zero_stage(ds) == 3 and dsc.offloads(ds)[1]):
        return
    fits = zero2_offload_that_fits(plan)
    if fits is None:
        return
    micro, gpu = fits
    report.notes.append(
        f"the parameters ZeRO-3 offloads here, and fetches for every micro-batch, fit on the GPU: "
        f"configs/zero2-offload.json (ZeRO-2, the optimizer offloaded, gradients accumulated in fp32 on the "
        f"GPU) fits at micro-batch {micro} by the estimate (~{gpu / GIB:.1f} GiB) and fetches nothing, the faster of "
        "the two where both fit (docs/PERFORMANCE.md)")


def note_faster_zero3_setup(plan: Plan, report: Report) -> None:
    """ZeRO-3 without offload where a faster setup fits the GPUs at the same micro-batch. With partitioned parameters
    ZeRO-3 gathers every layer's parameters for its forward and again for its backward: names "auto" persistence
    where whole parameters fit under ZeRO-3, else ZeRO-2 where that fits. With whole parameters already, ZeRO-2 where
    it fits: the same data cross the GPUs, without ZeRO-3's hooks on every module. Advice only: the config stays the
    user's."""
    if plan.memory_model is None or plan.ds_config is None:
        return
    where = "ZeRO-3 on several GPUs"
    if plan.memory_model.keeps_whole_parameters(plan.ds_config):
        why = ("ZeRO-3 with whole parameters moves the same weights and gradients per step and adds DeepSpeed's hooks "
               "on every module, which cost most where the layers are small")
    else:
        traffic = ""
        if plan.world > 1:
            value_bytes = 4 if dsc.precision(plan.ds_config) == "fp32" else 2
            quantized = plan.model.quantized  # QLoRA: the 4-bit weights gather at their own bytes
            weights = plan.model.num_params - (quantized.params * (1 - BYTES_PER_PARAM / value_bytes) if quantized
                                               else 0)
            sizes = (weights, plan.model.trainable_params, plan.world, plan.batch.accumulation, value_bytes)
            traffic = (f"; each GPU would receive ~{zero_traffic_per_step(*sizes, stage=2) / GIB:.1f} GiB of weights "
                       f"and gradients per step instead of ~{zero_traffic_per_step(*sizes, stage=3) / GIB:.1f}")
        whole = whole_parameters_that_fit(plan)
        if whole is not None:
            threshold = plan.ds_config["zero_optimization"].get("stage3_param_persistence_threshold")
            report.notes.append(
                f"whole parameters fit these GPUs at micro-batch {plan.batch.micro} by the estimate "
                f"(~{whole / GIB:.1f} GiB): ZeRO-3 would keep each on every GPU and run the same micro-batches "
                f"without gathering each layer's parameters for its forward and backward{traffic}: "
                f"\"stage3_param_persistence_threshold\": \"auto\" (now {threshold}) in zero_optimization where the "
                "run's speed matters (docs/PERFORMANCE.md, ZeRO-3 on several GPUs)")
            return
        if plan.world == 1:
            why = ("on one GPU ZeRO-3 partitions nothing, yet gathers each layer's parameters for its forward, its "
                   "recomputation and its backward; ZeRO-2 runs the same micro-batches without")
            where = "Long sequences, ZeRO-3 on one GPU"
        else:
            why = ("it keeps whole parameters on every GPU and runs the same micro-batches without gathering each "
                   f"layer's parameters for its forward and backward, as ZeRO-3 does{traffic}")
    gpu = zero2_that_fits(plan)
    if gpu is not None:
        report.notes.append(
            f"ZeRO-2 fits these GPUs at micro-batch {plan.batch.micro} by the estimate (~{gpu / GIB:.1f} GiB): {why}: "
            "\"stage\": 2 in the DeepSpeed config (ds_config.json has it) where the run's speed matters "
            f"(docs/PERFORMANCE.md, {where})")


def zero_traffic_per_step(params: int, trainable: int, world: int, accumulation: int, value_bytes: int,
                          stage: int) -> float:
    """Bytes one GPU receives per optimizer step through ZeRO's collectives (ring all-gather and reduce-scatter bring
    (world - 1) / world of the whole tensor): ZeRO-3 gathers every parameter for each micro-batch's forward and again
    for its backward and reduce-scatters the trainable ones' gradients; ZeRO-1/2, and ZeRO-3 with whole parameters,
    reduce-scatter each micro-batch's gradients and gather the updated parameters once per step (Rajbhandari et al.
    2020: 3 against 2 model sizes per step at one micro-batch). `value_bytes`: 2 for 16-bit weights and gradients, 4
    for fp32."""
    share = (world - 1) / world
    if stage == 3:
        return accumulation * (2 * params + trainable) * value_bytes * share
    return (accumulation + 1) * trainable * value_bytes * share


# Host seconds of each part of an offload update per 10^9 parameters of a rank's offloaded partition on a 16-core host
# (benchmarks/offload_step.py measures them; docs/PERFORMANCE.md, Where an offload step goes). Under ZeRO-3 the
# delayed update leaves the conversion at the step's boundary, since the forward fetches the weights from the 16-bit
# partitions it writes.
OFFLOAD_UPDATE_PARTS_S_PER_BILLION = {"clip": 0.058, "DeepSpeedCPUAdam": 0.205, "bf16 conversion": 0.072,
                                      "copy to the GPU": 0.036}


OFFLOAD_UPDATE_S_PER_BILLION = sum(OFFLOAD_UPDATE_PARTS_S_PER_BILLION.values())


def estimate_offload_update(plan: Plan, report: Report) -> None:
    """ZeRO with the optimizer offloaded: how long the GPU waits for each step's update on the host, and the flag
    that runs it beside the next step instead."""
    ds = plan.ds_config
    if not (dsc.cpu_optimizer_offload(ds) and plan.model.num_params):
        return
    from_step = plan.cfg.optim.delayed_update_from_step
    ratio = dsc.partial_offload_ratio(ds)
    offloaded = plan.model.num_params / plan.world * (1.0 if ratio is None else ratio)
    seconds = OFFLOAD_UPDATE_S_PER_BILLION * offloaded / 1e9
    zero3 = dsc.zero_stage(ds) == 3
    if not from_step:
        overlap = ("the GPU waits for it: --delayed_update_from_step S runs it beside the next step, whose gradients "
                   "are then taken one update late (docs/PERFORMANCE.md)")
    elif plan.batch.accumulation > 1:
        overlap = f"from step {from_step} on it runs beside the next step (--delayed_update_from_step)"
    else:  # the boundary backward copies the gradients into the buffers the update reads, so it waits for it
        overlap = (f"from step {from_step} on it runs beside the next step's forward only: with one micro-batch per "
                   "step its backward waits for the update; gradient accumulation (a smaller micro-batch for the same "
                   "--global_batch_tokens) lets the update run beside the other micro-batches")
    if from_step and zero3:
        overlap += (f", all but the conversion to 16 bits "
                    f"(~{OFFLOAD_UPDATE_PARTS_S_PER_BILLION['bf16 conversion'] * offloaded / 1e9:.1f} s), "
                    "which ZeRO-3 keeps at the step's boundary")
    share = "" if ratio is None else f" (the offloaded {ratio:g} of them)"
    report.estimate(f"offload update: ~{seconds:.1f} s per step on the host for each rank's "
                    f"{offloaded / 1e9:.2f}B parameters{share} (at a 16-core host's rate); {overlap}")
    if os.environ.get("OMP_NUM_THREADS") == "1":
        report.notes.append(
            "OMP_NUM_THREADS=1 (torchrun's default with several processes per node) runs the CPU optimizer update on "
            "one core per rank, not the estimate's 16: unset it (each rank then takes its share of "
            "the node's cores) or set it to the node's cores divided by its ranks")


def note_quantized_base(plan: Plan, report: Report) -> None:
    """QLoRA (--load_in_4bit): what the 4-bit base takes on each GPU, against its weights in 16-bit."""
    quantized = plan.model.quantized
    if quantized is None:
        return
    share = plan.ranks if dsc.zero_stage(plan.ds_config) == 3 else 1  # ZeRO-3 partitions the 4-bit values too
    bf16 = dsc.precision(plan.ds_config) != "fp32"
    count = f"{quantized.params / 1e9:,.2f}B" if quantized.params >= 1e9 else f"{quantized.params / 1e6:,.2f}M"
    whose = "the language model's" if plan.model.vision is not None else "the base's"  # a VLM's tower stays 16-bit
    report.estimate(f"QLoRA: {whose} {count} linear-layer weights take "
                    f"~{quantized.frozen_bytes(quantized.params, 2) / share / GIB:.2f} GiB per GPU in 4-bit NF4 "
                    f"({BYTES_PER_PARAM:.3f} byte a parameter with the double-quantized absmax), against "
                    f"{2 * quantized.params / share / GIB:.2f} GiB in 16-bit; each matmul dequantizes one weight "
                    f"(~{quantized.working_bytes(bf16) / 2**20:,.0f} MiB at most)"
                    + ("; the vision tower and the projector stay 16-bit" if plan.model.vision is not None else ""))


def check_memory(plan: Plan, report: Report) -> None:
    """The model, its size and FLOPs; each phase's memory against the GPU's, with the cheapest fix when it does not fit."""
    cfg, ds, mconf, micro = plan.cfg, plan.ds_config, plan.model.config, plan.batch.micro
    stage, (off_opt, off_par) = dsc.zero_stage(ds), dsc.offloads(ds)
    bf16 = dsc.precision(ds) != "fp32"
    report.lines.append(f"model: {cfg.model.model}, {plan.model.num_params / 1e6:,.1f}M parameters, "
                        f"{plan.model.flops.per_token() / 1e9:.2f} GFLOP/token, ZeRO stage {stage}"
                        f"{', optimizer offload' if off_opt else ''}{', parameter offload' if off_par else ''}")
    if plan.model.vision is not None:
        vision = plan.model.vision
        report.lines.append(vision.describe() + f"; the tower's activations ~"
                            f"{vision.activation_bytes(micro, plan.rank_seq_len, bf16) / GIB:.1f} GiB at most in the "
                            "train step (every token of a micro-batch an image's)")
    phases = plan.memory.phases
    peak_phase, total = phases.peak
    memory, where = plan.hardware.gpu_memory_gib, plan.hardware.gpu_memory_source
    report.estimate(f"memory: ~{total / GIB:.1f} GiB per GPU estimated, at its peak in {peak_phase} (train "
                    f"step {phases.train / GIB:.1f}: model states, ZeRO buckets, activations; evaluation "
                    f"{phases.evaluation / GIB:.1f}; export {phases.export / GIB:.1f}"
                    + (f"; generation {phases.generation / GIB:.1f}" if phases.generation else "")
                    + f"); GPU: {f'{memory:.0f} GiB ({where})' if memory else where}")
    if plan.parameters_choice:
        report.estimate(f"parameters: {plan.parameters_choice}")
    chunk = cfg.speed.flce_chunk_budget
    if plan.fused_loss and not plan.hardware.on_training_hardware and not speed.liger_available():
        logits = activation_bytes(mconf, plan.seq_len, micro, False, False, bf16, chunk) - activation_bytes(
            mconf, plan.seq_len, micro, False, True, bf16, chunk)
        report.estimate(f"memory: assumes Liger's fused cross-entropy on the GPU nodes (not installed "
                        f"here); without it the logits add ~{logits / GIB:.0f} GiB")
    if memory and 0.92 * memory * GIB < total <= memory * GIB:
        report.notes.append(f"the memory estimate is within 8% of the GPU's {memory:.0f} GiB: expect little headroom")
    if memory and total > memory * GIB and peak_phase == "generation":
        report.problems.append(Problem(
            "--generate_prompt", cfg.logging.generate_prompt, f"loading the exported model for the sample needs "
            f"~{total / GIB:.0f} GiB per GPU beside the engine, more than the {memory:.0f} GiB available",
            "drop --generate_prompt and run `python -m model_utils.generate --model EXPORT_DIR` after the run"))
    elif memory and total > memory * GIB:
        split = split_that_fits(plan) if micro == 1 else None
        fits = cheapest_fit(plan.model.trainable_params, mconf, plan.ranks, plan.rank_seq_len, micro, bf16,
                            plan.fused_loss, chunk, memory, ds.get("zero_optimization", {}),
                            speed.use_compile(plan.hardware.gpus, False, plan.cfg.speed), plan.hardware.host_available,
                            plan.hardware.ranks_per_node, adapters=plan.model.adapters,
                            frozen_params=plan.model.frozen_params, quantized=plan.model.quantized)
        offload = offload_that_fits(plan)
        larger = split_on_a_larger_node(plan) if split is None and not offload else None
        report.problems.append(Problem(
            "train_micro_batch_size_per_gpu / zero_optimization", f"micro {micro}, ZeRO {stage}",
            f"needs ~{total / GIB:.0f} GiB per GPU, more than the {memory:.0f} GiB available",
            (f"keep the recomputed layers' inputs in host memory: --offload_activations (~{offload / GIB:.0f} GiB of "
             "host memory per node, by the estimate); or " if offload else "")
            + (f"split each sequence across {split} GPUs: --sequence_parallel {split} (by the estimate); or "
               if split else "")
            + (f"on a node of {larger[0]} GPUs, split each sequence across them: --sequence_parallel {larger[0]} "
               + (f"(~{larger[1] / GIB:.0f} GiB of host memory for the offloaded inputs, " if larger[1] else "(")
               + "by the estimate); or " if larger else "") + fits))


def offload_that_fits(plan: Plan) -> float | None:
    """The host memory per node with which --offload_activations fits the plan's sequences at micro-batch 1 on its
    GPUs and in the node's free memory, by the estimate; None where it is on already, nothing recomputes, or it does
    not fit."""
    if (not _sized(plan) or plan.cfg.model.offload_activations or not plan.memory.checkpointed_layers
            or plan.batch.micro != 1 or not train_fits(plan, offload_activations=True)):
        return None
    need, room = offloaded_inputs_bytes(plan, plan.rank_seq_len), host_room(plan)
    return None if room is not None and need > room else need


# ----------------------------------------------------------------------------------------------------------------------
# Alternatives the preflight proposes (what-ifs on a plan; none changes the user's config)
# ----------------------------------------------------------------------------------------------------------------------
def automatic_micro_batch(plan: Plan) -> int | None:
    """The micro-batch "auto" would take for this plan's config and per-rank batch (the largest that divides it and
    fits by the estimate); None where no GPU size or model is known."""
    if plan.memory_model is None or plan.memory_model.budget is None or plan.batch is None:
        return None
    per_rank = plan.batch.micro * plan.batch.accumulation
    return plan.memory_model.largest_fitting_micro(plan.ds_config, lambda m: per_rank % m == 0)[0]


# The share of a node's available memory a proposed offload may plan to fill: the model of the offloaded states came
# within 2% of the measured peaks (docs/PERFORMANCE.md), and the node's other processes and page cache need the rest.
HOST_MEMORY_SHARE = 0.9


def partial_offload_that_fits(plan: Plan, host_available: float) -> tuple[float, str, float, float] | None:
    """For offloaded states that do not fit the node: a ZeRO-3 run with part of its optimizer offloaded, the largest
    `offload_optimizer.ratio` (steps of 0.05) whose host memory fits HOST_MEMORY_SHARE of `host_available` and whose
    GPU part fits AUTO_MEMORY_SHARE of the GPU at micro-batch 1. The parameters stay on the GPU where they fit there
    (offload_param none: each micro-batch would otherwise fetch all of them from host memory twice), and are offloaded
    otherwise. Returns (ratio, offload_param device, host bytes, GPU bytes), or None."""
    memory_model = plan.memory_model
    if memory_model is None or memory_model.budget is None or plan.ds_config is None:
        return None
    ds = copy.deepcopy(plan.ds_config)
    ds.pop("data_types", None)  # as configs/zero3-offload.json, which the fix names: gradients accumulate in bf16
    zero = ds.setdefault("zero_optimization", {})
    zero["stage"] = 3
    offload = zero.setdefault("offload_optimizer", {})
    offload["device"] = "cpu"
    for param_device in ("none", "cpu"):
        zero.setdefault("offload_param", {})["device"] = param_device
        for step in range(19, 0, -1):
            offload["ratio"] = step / 20
            host = memory_model.host_bytes(ds)
            if host > HOST_MEMORY_SHARE * host_available:
                continue
            gpu = memory_model.peak(ds, 1)
            if gpu <= memory_model.budget:
                return offload["ratio"], param_device, host, gpu
            break  # a smaller ratio keeps more of the optimizer on the GPU
    return None


def checkpointed_micro_that_fits(plan: Plan) -> tuple[int, float] | None:
    """For a run without activation checkpointing: the automatic micro-batch of the same config and per-rank batch with
    --gradient_checkpointing, and its GPU bytes, where that micro-batch is larger than this run's (under ZeRO-3 with
    the parameters offloaded it fetches them fewer times per step); else None."""
    if plan.cfg.model.gradient_checkpointing or plan.memory_model is None:
        return None
    checkpointed = dataclasses.replace(plan, memory_model=dataclasses.replace(plan.memory_model,
                                                                              gradient_checkpointing=True))
    micro = automatic_micro_batch(checkpointed)
    if micro is None or micro <= plan.batch.micro:  # None: no GPU size known; a micro-batch of 1 where none fits
        return None
    return micro, checkpointed.memory_model.peak(plan.ds_config, micro)


def _as_zero2(ds: dict, config: str) -> dict:
    """`ds` as ZeRO-2 (a copy): ZeRO-3's settings and parameter offload dropped, the gradient buckets of the
    repository's ZeRO-2 `config` (ZeRO-3's "auto" buckets are sized for its modules, not ZeRO-2's reduction; none
    where the repository's configs are not at hand)."""
    ds = copy.deepcopy(ds)
    zero = {key: value for key, value in ds.get("zero_optimization", {}).items()
            if not key.startswith("stage3_") and key != "offload_param"}
    path = REPO_ROOT / config
    if path.is_file():
        written = json.loads(path.read_text()).get("zero_optimization", {})
        zero.update({key: written[key] for key in ("reduce_bucket_size", "overlap_comm", "contiguous_gradients")
                     if key in written})
    ds["zero_optimization"] = dict(zero, stage=2)
    return ds


def zero2_that_fits(plan: Plan) -> float | None:
    """For ZeRO-3 without offload: the same config as ZeRO-2 (ds_config.json's gradient buckets), which keeps whole
    parameters on every GPU. Returns its GPU bytes where it fits the GPU at this run's micro-batch, else None."""
    memory_model = plan.memory_model
    if (memory_model is None or memory_model.budget is None or plan.ds_config is None or plan.batch is None
            or dsc.zero_stage(plan.ds_config) != 3 or any(dsc.offloads(plan.ds_config))):
        return None
    ds = _as_zero2(plan.ds_config, "ds_config.json")
    gpu = memory_model.peak(ds, plan.batch.micro)
    return gpu if gpu <= memory_model.budget else None


def whole_parameters_that_fit(plan: Plan) -> float | None:
    """For a run whose ZeRO-3 parameters are partitioned where "auto" persistence could keep them whole
    (MemoryModel.may_keep_whole_parameters): the same config with every parameter whole on each GPU. Returns its GPU
    bytes where it fits the GPU at this run's micro-batch, else None."""
    memory_model = plan.memory_model
    if (memory_model is None or plan.ds_config is None or plan.batch is None
            or not memory_model.may_keep_whole_parameters(plan.ds_config)
            or memory_model.keeps_whole_parameters(plan.ds_config)):
        return None
    gpu = memory_model.peak(dsc.with_whole_parameters(plan.ds_config, plan.model.largest_param), plan.batch.micro)
    return gpu if gpu <= memory_model.budget else None


def zero2_offload_that_fits(plan: Plan) -> tuple[int, float] | None:
    """For ZeRO-3 with the parameters offloaded: configs/zero2-offload.json's setup (ZeRO-2, the whole optimizer
    offloaded, fp32 gradient accumulation on the GPU) at this world and per-rank batch, which keeps the parameters on
    every GPU and so fetches none from host memory. Returns (its automatic micro-batch, its GPU bytes) where that fits
    the GPU and its host part no more than this config's, else None."""
    memory_model = plan.memory_model
    if memory_model is None or memory_model.budget is None or plan.ds_config is None or plan.memory is None:
        return None
    ds = _as_zero2(plan.ds_config, "configs/zero2-offload.json")
    ds["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    ds["data_types"] = {"grad_accum_dtype": "fp32"}
    per_rank = plan.batch.micro * plan.batch.accumulation
    micro = memory_model.largest_fitting_micro(ds, lambda m: per_rank % m == 0)[0]
    gpu = memory_model.peak(ds, micro)
    if gpu > memory_model.budget or memory_model.host_bytes(ds) > (plan.memory.host_bytes or 0):
        return None
    return micro, gpu
