"""The state of a run: everything the loop needs, built once by `build.build_run`, advanced by every step."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from deepspeed import DeepSpeedEngine
from transformers import PreTrainedTokenizerBase

from model_utils.checkpoint.background import BackgroundSaves
from model_utils.config.batch import Batch
from model_utils.config.settings import TrainConfig
from model_utils.core.run_dir import RunDir
from model_utils.data.blocks import BlockOrder, DataPosition, PackedData
from model_utils.models.build import FlopsModel
from model_utils.models.offload import HostActivations
from model_utils.runtime.distributed import Dist
from model_utils.runtime.run_log import Logger


@dataclass
class Run:
    """Everything the loop needs, built by `build_run`; `step`, `tokens_seen` and `position` advance as it trains."""

    cfg: TrainConfig
    dist: Dist
    run_dir: RunDir
    ds_config: dict  # resolved: no "auto" left
    tokenizer: PreTrainedTokenizerBase
    model: torch.nn.Module
    engine: DeepSpeedEngine
    data: PackedData
    order: BlockOrder
    batch: Batch  # micro-batch, accumulation, world size, block length
    flops: FlopsModel
    log: Logger
    data_identity: dict  # what the data position means (manifest: seq_len, tokenizer, data); see data_identity()
    speed_in_force: dict  # the speed options in force (apply_speed_options, streamline_zero_step, the delayed update)
    peak_tflops: float | None = None
    document_eos: int | None = None  # --document_mask: the token that ends a document
    document_boundaries: bool = False  # the attention takes documents as boundaries (FlashAttention-4), not a mask
    lora: object = None  # config.settings.LoraSettings of a LoRA run; None: every weight trains
    examples: bool = False  # fine-tuning data (sft_data): blocks of examples with their labels and positions
    preference: object = None  # config.preference.PreferenceSettings of a preference run (its data are pairs)
    vision: object = None  # planning.vision.VisionPlan of a vision-language model (its processor, parts, FLOPs)
    custom: object = None  # planning.custom.CustomPlan of a model of your own (its hooks, its export)
    stages: object = None  # train.stages.Curriculum of a run with stages (their steps, data, orders)
    reference: object = None  # data.preference.reference.StoredReference: the step-0 model's log-probs of the pairs
    offload: HostActivations | None = None  # --offload_activations: the host buffers of what each forward keeps
    step: int = 0
    tokens_seen: int = 0
    position: DataPosition | None = None
    saves: BackgroundSaves | None = None  # checkpoints written in the background, else None: saves block
    incomplete_moved: tuple[str, ...] = ()  # incomplete checkpoints this start moved aside (rank 0)
