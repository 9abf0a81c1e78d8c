"""The memory model of a plan: the hardware it plans for, the model's sizes (measured on the meta device), and each
phase's GPU memory and the host's for any DeepSpeed config and micro-batch; and the choices the plan makes with it:
ZeRO-3's parameters whole or partitioned, the delayed update's prefetch, and how many layers recompute.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from model_utils.config import deepspeed as dsc
from model_utils.config.settings import SpeedConfig, TrainConfig
from model_utils.core.problems import Problem
from model_utils.models.memory import (AUTO_MEMORY_SHARE, GIB, PhaseMemory, choose_micro_batch, offload_host_bytes,
                                       phase_memory)
from model_utils.models.sequence_parallel import uses_tiled_mlp
from model_utils.models.speed import use_compile, zero3_keeps_eager_layers


@dataclass(frozen=True)
class MemoryModel:
    """Each phase's estimated GPU memory, and the host memory of offloaded states, for any DeepSpeed config and
    micro-batch of this model on this hardware: what the automatic micro-batch, the recomputed layers and the
    preflight's alternatives are chosen by."""

    model: ModelPlan
    hardware: Hardware
    world: int
    seq_len: int
    speed: SpeedConfig
    fused_loss: bool  # Liger's fused linear cross-entropy (the logits' memory depends on it)
    gradient_checkpointing: bool
    generation: bool  # the end-of-run sample loads the export beside the engine
    delayed_update_from_step: int
    batch: object  # config.batch.BatchRequest: the accumulation at each micro-batch
    offload_activations: bool = False  # --offload_activations: the recomputed layers' inputs in host memory
    tiled_mlp: str = "off"  # --tiled_mlp: on, off or auto (by the tokens one GPU holds, seq_len, and the budget)

    def compiles(self, ds: dict) -> bool:
        """Whether the run compiles its decoder layers (models.speed.use_compile), on the GPUs it trains on."""
        eager = zero3_keeps_eager_layers(dsc.zero_stage(ds), any(dsc.offloads(ds)), self.model.lora is not None)
        quantized = self.model.quantized is not None  # 4-bit layers run eager (config.checks.qlora_problems)
        return use_compile(self.hardware.gpus, eager or quantized, self.speed)

    def keeps_whole_parameters(self, ds: dict) -> bool:
        """Whether ZeRO-3 keeps every parameter whole on each GPU with `ds`
        (config.deepspeed.keeps_whole_parameters)."""
        return dsc.keeps_whole_parameters(ds, self.model.largest_param, self.model.num_params)

    def may_keep_whole_parameters(self, ds: dict) -> bool:
        """Where "auto" persistence may keep ZeRO-3's parameters whole: a GPU size to fit them in, ZeRO-3, nothing
        offloaded and no LoRA (whole parameters are measured and tested without either)."""
        return (self.budget is not None and dsc.zero_stage(ds) == 3 and not any(dsc.offloads(ds))
                and self.model.lora is None and self.model.largest_param > 0)

    def prefetch_applies(self, ds: dict) -> bool:
        """Whether the delayed update can keep a second GPU copy of the 16-bit partition: ZeRO-1/2 with the optimizer
        offloaded to the CPU, --delayed_update_from_step, GPUs."""
        return bool(self.delayed_update_from_step and dsc.cpu_optimizer_offload(ds) and dsc.zero_stage(ds) in (1, 2)
                    and self.hardware.gpus)

    def phases(self, ds: dict, micro: int, checkpointed_layers: int | None = None,
               prefetch: bool | None = None) -> PhaseMemory:
        """Each phase's estimated peak per GPU with `ds` and micro-batch `micro`; with --gradient_checkpointing,
        `checkpointed_layers` of the layers recompute (None: all of them); `prefetch`: the delayed update's second GPU
        buffer (None: where --delayed_update_prefetch is on, not auto, and applies)."""
        if prefetch is None:
            prefetch = self.speed.delayed_update_prefetch == "on" and self.prefetch_applies(ds)
        off_opt, off_par = dsc.offloads(ds)
        phases = phase_memory(self.model.trainable_params, self.model.config, self.world, self.seq_len, micro,
                              dsc.zero_stage(ds), off_opt, off_par, dsc.precision(ds) != "fp32",
                              ds.get("zero_optimization", {}), self.gradient_checkpointing, self.fused_loss,
                              self.speed.flce_chunk_budget, self.generation,
                              fp32_grad_accumulation=dsc.fp32_grad_accumulation(ds), compiled=self.compiles(ds),
                              gpu_optimizer_share=self.gpu_optimizer_share(ds),
                              checkpointed_layers=checkpointed_layers, delayed_prefetch=prefetch,
                              accumulation=self.batch.accumulation_at(micro), frozen_params=self.model.frozen_params,
                              adapters=self.model.adapters, whole_params=self.keeps_whole_parameters(ds),
                              offloaded_activations=self.offload_activations,
                              tiled_mlp=self.tiles_mlp(ds, micro, checkpointed_layers, prefetch),
                              quantized=self.model.quantized)
        if self.model.vision is None:
            return phases
        vision, bf16 = self.model.vision, dsc.precision(ds) != "fp32"
        return replace(phases, train=phases.train + vision.activation_bytes(micro, self.seq_len, bf16),
                       evaluation=phases.evaluation + vision.block_bytes(micro, self.seq_len, bf16))

    def tiles_mlp(self, ds: dict, micro: int, checkpointed_layers: int | None = None,
                  prefetch: bool | None = None) -> bool:
        """--tiled_mlp as the run applies it: on, off, or auto: where a GPU holds TILED_MLP_MIN_TOKENS of a sequence
        or more, unless a GPU size is known and the step fits its budget untiled (tiles recompute each MLP in the
        backward pass outside the compiled layer, which costs speed where memory does not need them). LoRA runs keep
        the tiles: the estimate does not hold LoRA's untiled activations at length (docs/PERFORMANCE.md, Long
        sequences, sets both beside the measured steps and peaks)."""
        if self.tiled_mlp != "auto" or not uses_tiled_mlp("auto", self.seq_len, 1):
            return uses_tiled_mlp(self.tiled_mlp, self.seq_len, 1)
        if self.budget is None or self.model.lora is not None:
            return True
        untiled = replace(self, tiled_mlp="off")
        return untiled.phases(ds, micro, checkpointed_layers, prefetch).train > self.budget

    def peak(self, ds: dict, micro: int, checkpointed_layers: int | None = None, prefetch: bool | None = None) -> float:
        return self.phases(ds, micro, checkpointed_layers, prefetch).peak[1]

    def gpu_optimizer_share(self, ds: dict) -> float:
        return dsc.gpu_optimizer_share(ds, [list(g) for g in self.model.param_groups], self.world)

    def host_bytes(self, ds: dict) -> float:
        """Host memory a node needs for the states `ds` offloads (models.memory.offload_host_bytes)."""
        return offload_host_bytes(self.model.trainable_params, self.world, self.hardware.ranks_per_node,
                                  dsc.zero_stage(ds), *dsc.offloads(ds), dsc.fp32_grad_accumulation(ds),
                                  gpu=self.hardware.gpus, gpu_optimizer_share=self.gpu_optimizer_share(ds),
                                  pinned_optimizer=bool(dsc.offload_setting(ds, "offload_optimizer", "pin_memory")),
                                  frozen_params=self.model.frozen_params, quantized=self.model.quantized)

    def largest_fitting_micro(self, ds: dict, allowed) -> tuple[int, str]:
        """The automatic micro-batch (models.memory.choose_micro_batch) with `ds`; the default where no GPU size is
        known."""
        if self.hardware.gpu_memory_gib is None:
            return choose_micro_batch(self.seq_len, None, None, allowed)
        return choose_micro_batch(self.seq_len, self.hardware.gpu_memory_gib, lambda m: self.peak(ds, m), allowed)

    @property
    def budget(self) -> float | None:
        """The bytes of one GPU an automatic choice may fill (AUTO_MEMORY_SHARE); None where no size is known."""
        memory = self.hardware.gpu_memory_gib
        return None if memory is None else AUTO_MEMORY_SHARE * memory * GIB


# The automatic choice keeps ZeRO-3's parameters whole where that costs at most half the micro-batch: whole parameters
# at half the micro-batch train as fast as partitioned ones at the full one (docs/PERFORMANCE.md, ZeRO-3 on several
# GPUs).
WHOLE_PARAMETERS_MICRO_SHARE = 0.5


def choose_whole_parameters(memory_model: MemoryModel, ds: dict, raw: dict, micro: int | None,
                            allowed) -> tuple[dict, str | None]:
    """ZeRO-3's `"stage3_param_persistence_threshold": "auto"` resolved, before the micro-batch: every parameter
    persistent (config.deepspeed.keeps_whole_parameters: nothing gathered per micro-batch) where the estimate with whole
    parameters fits AUTO_MEMORY_SHARE of the GPU at the given micro-batch, or, for an automatic one, at no less than
    WHOLE_PARAMETERS_MICRO_SHARE of the micro-batch partitioned parameters would allow. Otherwise, where
    MemoryModel.may_keep_whole_parameters rules them out or the config sets a number, `ds` as resolve_settings left it
    (Hugging Face's 10 x hidden). Returns (the config, the header's line saying which and why; None where "auto"
    decided nothing)."""
    if not (memory_model.may_keep_whole_parameters(ds) and dsc.persistence_is_auto(raw)):
        return ds, None
    budget = memory_model.budget
    whole = dsc.with_whole_parameters(ds, memory_model.model.largest_param)
    if micro is None:
        micro = memory_model.largest_fitting_micro(whole, allowed)[0]
        partitioned = memory_model.largest_fitting_micro(ds, allowed)[0]
        enough = micro >= WHOLE_PARAMETERS_MICRO_SHARE * partitioned
        shortfall = f"micro-batch {micro} against {partitioned} with them partitioned"
    else:
        enough, shortfall = True, ""
    need = memory_model.peak(whole, micro)
    where = f"~{need / GIB:.1f} GiB at micro-batch {micro}, {AUTO_MEMORY_SHARE:.0%} of the GPU is {budget / GIB:.1f}"
    if need <= budget and enough:
        largest = memory_model.model.largest_param
        return whole, (f"ZeRO-3 keeps every parameter whole on each GPU (\"stage3_param_persistence_threshold\": "
                       f"\"auto\" -> {largest:,} elements, the largest parameter; {where}): no layer is gathered "
                       "for its forward or backward")
    why = shortfall if need <= budget else where
    return ds, (f"ZeRO-3 partitions the parameters (\"stage3_param_persistence_threshold\": \"auto\" -> "
                f"{ds['zero_optimization']['stage3_param_persistence_threshold']:,}): whole ones would take {why}")


def choose_prefetch(speed: SpeedConfig, memory_model: MemoryModel, ds: dict, micro: int,
                    layers: int | None) -> tuple[bool, str | None]:
    """--delayed_update_prefetch resolved, after the micro-batch and the recomputed layers. auto: on where the run's
    estimated peak with the second buffer still fits AUTO_MEMORY_SHARE of the GPU (or no GPU size is known), so that
    it never takes a larger micro-batch's or a kept layer's place."""
    setting = speed.delayed_update_prefetch
    if setting == "off" or not memory_model.prefetch_applies(ds):
        return False, None
    if setting == "on":
        return True, None
    budget = memory_model.budget
    if budget is None:
        return True, f"auto: on ({memory_model.hardware.gpu_memory_source}: no GPU size to fill)"
    need = memory_model.peak(ds, micro, layers, prefetch=True)
    on = need <= budget
    return on, (f"auto: {'on' if on else 'off'}, ~{need / GIB:.1f} GiB with it, {AUTO_MEMORY_SHARE:.0%} of the GPU is "
                f"{budget / GIB:.1f}")


def choose_checkpointed_layers(cfg: TrainConfig, memory_model: MemoryModel, ds: dict,
                               micro: int) -> tuple[int | None, str | None, list[Problem]]:
    """--checkpointed_layers resolved to a count: (count, how auto chose, problems). auto: the fewest recomputed
    layers with which the run's estimated peak fits AUTO_MEMORY_SHARE of the GPU at the micro-batch chosen with all
    of them recomputed (so "auto" micro-batch and layers together never pick a smaller micro-batch than all layers
    would); all where no GPU size is known."""
    if not cfg.model.gradient_checkpointing:
        return None, None, []
    layers, problems = memory_model.model.config.num_hidden_layers, []
    wanted, checkpointable = cfg.model.checkpointed_layers, memory_model.model.checkpointable_layers
    if wanted != "all" and checkpointable != layers:
        problems.append(Problem("--checkpointed_layers", wanted,
                                f"needs layers transformers checkpoints one by one: {cfg.model.model} has "
                                f"{checkpointable} of its {layers}",
                                "leave --checkpointed_layers at all (every layer recomputes)"))
        wanted = "all"
    if isinstance(wanted, int):
        if wanted > layers:
            problems.append(Problem("--checkpointed_layers", wanted, f"exceeds the {layers} decoder layers of "
                                    f"{cfg.model.model}", f"pass at most {layers}, or all"))
        return min(wanted, layers), None, problems
    if wanted == "all":
        return layers, None, problems
    budget = memory_model.budget
    if budget is None:
        return layers, f"auto: all ({memory_model.hardware.gpu_memory_source}: no GPU size to fill)", problems
    for count in range(layers + 1):
        peak = memory_model.peak(ds, micro, count)
        if peak <= budget:
            return count, (f"auto: the fewest with which the run fits {AUTO_MEMORY_SHARE:.0%} of the GPU by the "
                           f"estimate (~{peak / GIB:.1f} GiB of {memory_model.hardware.gpu_memory_gib:.1f})"), problems
    return layers, f"auto: all (fewer do not fit {AUTO_MEMORY_SHARE:.0%} of the GPU)", problems


@dataclass(frozen=True)
class Hardware:
    """Where the plan is made, and the machines it plans for."""

    on_training_hardware: bool  # planned where the run trains (its own start, or a GPU node): this machine decides
    gpus: bool  # the run trains on GPUs: this machine's, or those of the nodes a login node plans for
    precision: str  # the best the training devices support: bf16, fp16 or fp32 (config.deepspeed.hardware_precision)
    gpu_memory_gib: float | None  # one GPU's memory; None where no size is known
    gpu_memory_source: str  # the GPU's name, GPU_MEMORY_GIB, or why no size is known
    host_available: float | None  # this node's MemAvailable where the run starts; None on a login node
    ranks_per_node: int


@dataclass(frozen=True)
class ModelPlan:
    """The model as the run will build it, sized on the meta device."""

    tokenizer: object
    config: object  # transformers PretrainedConfig
    num_params: int
    param_groups: tuple[tuple[int, ...], ...]  # the optimizer's groups' parameter sizes (models.build.decay_groups)
    checkpointable_layers: int  # the layers transformers checkpoints one by one (models.build.checkpointable_layers)
    flops: object  # models.build.FlopsModel
    frozen_params: int = 0  # parameters that do not train (the model's own weights under LoRA), in num_params
    lora: object = None  # config.settings.LoraSettings; None: every weight trains
    adapters: object = None  # models.memory.AdapterActivations: LoRA's adapters per layer, as their activations scale
    largest_param: int = 0  # the largest parameter's elements (the embedding or the LM head, frozen ones included)
    quantized: object = None  # models.memory.QuantizedBase: QLoRA's 4-bit base (--load_in_4bit); None: 16-bit weights
    vision: object = None  # planning.vision.VisionPlan of a vision-language model (config is its language model's)
    custom: object = None  # planning.custom.CustomPlan of a model of your own (config is None)

    @property
    def trainable_params(self) -> int:
        return self.num_params - self.frozen_params

    @property
    def layer_params(self) -> int:
        """One decoder layer's parameters (the non-embedding ones shared out over the layers)."""
        return self.flops.non_embedding_params // max(1, self.flops.num_layers)
