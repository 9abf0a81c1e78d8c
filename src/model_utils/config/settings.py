"""The configuration: one typed dataclass per concern (model, data, batch, optimisation, checkpointing, logging,
speed), each field with its default and help text (flags.py makes them flags, checks.py validates them), and the LoRA
settings.

Hyperparameters that DeepSpeed owns (micro-batch, accumulation, optimizer, scheduler, clipping, ZeRO, precision) live in
`ds_config.json`. The flags below that shadow them (`--micro_batch_size`, `--learning_rate`, ...) are optional
overrides: unset, the config's value stands; set, they replace it and the run says so.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import asdict, dataclass, field
from pathlib import Path

from model_utils.core.problems import Problem
from model_utils.core.repo import REPO_ROOT
from model_utils.core.run_dir import RunDir


def _f(default, help: str, **kw):
    return field(default=default, metadata={"help": help, **kw})


@dataclass(frozen=True)
class SpeedConfig:
    """Speed options: how the same model and optimisation run faster on GPUs. Each takes the libraries' own path where
    it cannot apply (no GPU, ZeRO-3, a package or tested version missing) and the log says which path runs, so CPU runs
    and CI take the trainer's code path. docs/PERFORMANCE.md gives each option's measured gain and the command that
    reproduces it. The settings are recorded in the run header, summary.json, W&B and every checkpoint's manifest; a
    resume whose options change the numerics says so."""

    fused_kernels: str = _f("auto", "Liger-Kernel's Triton kernels: on, off, or auto (on with CUDA and liger-kernel "
                                    "installed). Liger's fused linear cross-entropy never materialises the batch's "
                                    "fp32 logits.", choices=("auto", "on", "off"), numerics=True)
    liger_kernels: str = _f("auto", "Which Liger kernels --fused_kernels applies: all (RoPE, RMSNorm, SwiGLU and the "
                                    "fused linear cross-entropy) or flce (the fused linear cross-entropy alone). auto: "
                                    "flce where the decoder layers are compiled (Inductor fuses the rest), else all.",
                            choices=("auto", "all", "flce"), numerics=True)
    flce_chunk_budget: int = _f(8, "Transient logits of Liger's fused linear cross-entropy, in multiples of the hidden "
                                   "states' size (Liger's chunk_mem_const; its own default, 1, cuts a 32k-token batch "
                                   "with a 152k vocabulary into 128 chunks that each re-read the LM-head gradient; 8 "
                                   "makes 16 chunks of 2,048 tokens). Lowered where a micro-batch's "
                                   "transient logits would pass 4 GiB (long sequences).", choices=(1, 2, 4, 8, 16),
                                numerics=True)
    compile: str = _f("auto", "torch.compile each decoder layer in place (one graph shared by all layers): layers, off; "
                              "auto = layers with CUDA, except where ZeRO-3 keeps them eager (with offload, or with "
                              "LoRA); under ZeRO-3 each compiled layer is gathered whole by hooks outside its graph.",
                      choices=("auto", "layers", "off"), numerics=True)
    activation_budget: float = _f(0.9, "torch.compile's activation memory budget for the compiled layers: the share of "
                                       "what they would save for the backward pass that they keep (the cheapest rest "
                                       "is recomputed). 1.0 recomputes nothing.", numerics=False)
    attention_kernel: str = _f("auto", "fa4: FlashAttention-4 (package flash-attn-4) for causal attention on "
                                       "Hopper/Blackwell GPUs, SDPA for anything it does not cover; varlen: documents "
                                       "and packed examples through PyTorch's variable-length FlashAttention (Ampere "
                                       "on), no dense mask; sdpa: SDPA only (transformers' mask for documents); auto: "
                                       "fa4 where it is installed, the GPU supports it and a setup probe passes, else "
                                       "for documents varlen where it runs, else SDPA once per document on a GPU.",
                               choices=("auto", "fa4", "varlen", "sdpa"), numerics=True)
    sdpa_backend: str = _f("auto", "SDPA kernel tried first (the others stay as fall-backs): cudnn, flash, efficient, "
                                   "math; auto keeps PyTorch's order.",
                           choices=("auto", "cudnn", "flash", "efficient", "math"), numerics=True)
    overflow_check: str = _f("auto", "How ZeRO-1/2 in bf16 finds a non-finite gradient and skips the step (the same "
                                     "steps in every mode): scan (DeepSpeed's scan of every gradient tensor), norm "
                                     "(through the all-reduced global gradient norm), device (norm, with the skip done "
                                     "by the fused AdamW on the GPU and booked by the loop). auto = device where it "
                                     "applies (torch's fused AdamW, no offload, a DeepSpeed LR scheduler), else norm.",
                             choices=("auto", "device", "norm", "scan"), numerics=False)
    delayed_update_prefetch: str = _f("auto", "With --delayed_update_from_step under ZeRO-1/2 on GPUs: the host "
                                              "copies each update's 16-bit weights to a second GPU buffer as soon as "
                                              "they are ready (2 bytes per parameter of the rank's partition), so that "
                                              "the step's boundary copies them within the GPU instead of over PCIe "
                                              "while the next forward waits. on, off, or auto: on where the run's "
                                              "memory estimate with the buffer fits the GPU at the micro-batch and "
                                              "checkpointed layers chosen without it.",
                                      choices=("auto", "on", "off"), numerics=False)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def numerics_options(cls) -> frozenset:
        """The options that change the numerics (kernels, rounding); the others (the overflow check, the activation
        budget) change only speed or memory."""
        return frozenset(f.name for f in dataclasses.fields(cls) if f.metadata.get("numerics"))

    def numerics_changes(self, recorded: dict) -> list[str]:
        """The numerics-changing options whose value differs from `recorded` (a checkpoint manifest's), as 'name: old -> new'."""
        return [f"{name}: {recorded[name]} -> {value}" for name, value in self.as_dict().items()
                if name in self.numerics_options() and name in recorded and recorded[name] != value]


@dataclass(frozen=True)
class ModelConfig:
    """Which model trains and how its layers run."""
    model: str = _f("tiny", "Preset name (tiny, qwen3-0.6b, qwen3-1.7b, qwen3-4b, qwen3-8b, llama-1b, llama-7b, llama-8b; "
                            "random init), a Hugging Face model directory / hub id (pretrained weights, continued "
                            "training), or FILE.py:FUNCTION, a model of your own (docs/YOUR-MODEL.md).")
    tokenizer: str | None = _f(None, "Tokenizer name or path for AutoTokenizer. Default: the project's shipped "
                                     "tokenizer for presets, the model's own tokenizer for a pretrained model.")
    seq_len: int | None = _f(None, "Tokens per packed training block. Default: the preset's context length "
                                   "(256 for tiny, 4096 for the others), or 2048 for a pretrained model.")
    attn_implementation: str = _f("sdpa", "Attention backend passed to transformers: sdpa, eager, flash_attention_2.")
    attention_dropout: float | None = _f(None, "Dropout on the attention weights in training (the config's "
                                               "attention_dropout). Default: the model's own (0.0 for the presets).")
    gradient_checkpointing: bool = _f(False, "Recompute activations in the backward pass (less memory, ~30% more compute).")
    checkpointed_layers: int | str = _f("all", "With --gradient_checkpointing: how many decoder layers recompute their "
                                               "activations, the first ones; the rest keep them. all; auto (the fewest "
                                               "with which the run still fits the GPU by the preflight's memory "
                                               "estimate, at the micro-batch all of them allow: the memory left over "
                                               "buys back recomputation); or a count.", parse="layer_count")
    offload_activations: bool = _f(False, "With --gradient_checkpointing: keep each recomputed layer's input in "
                                          "pinned host memory instead of on the GPU (ALST's checkpoint offload), "
                                          "copied back as the backward pass reaches the layer: at long sequences "
                                          "these inputs (2 bytes x tokens x hidden size per layer) are what remains "
                                          "on the GPU.")
    rope_scaling: str | None = _f(None, "Scale the model's rotary position embeddings to train past its "
                                        "max_position_embeddings: TYPE:FACTOR, TYPE linear or yarn (transformers' "
                                        "rope types), e.g. yarn:4 makes a 131,072-position model take 524,288. The "
                                        "positions it allows grow by FACTOR; an export carries the scaling. Default: "
                                        "the model's own RoPE.", parse="rope_scaling")
    sequence_parallel: int = _f(1, "Sequence parallelism (DeepSpeed's Ulysses, ALST): each sequence split across this "
                                   "many GPUs of a node, attention exchanging heads for sequence by all-to-all; data "
                                   "parallelism (ZeRO) over the GPUs / N groups. 1: off, every GPU holds whole "
                                   "sequences. Needs the attention heads, key-value heads and --seq_len divisible by "
                                   "N (docs/LONG-CONTEXT.md).")
    tiled_mlp: str = _f("auto", "Run each decoder layer's MLP over the sequence in tiles and recompute it in the "
                                "backward pass (DeepSpeed's TiledMLP): the MLP's activations of one tile instead of "
                                "the whole sequence, for one more MLP forward. on, off, or auto (on where a GPU holds "
                                "at least 32,768 tokens of a sequence, --seq_len / --sequence_parallel, unless the "
                                "step fits the GPU without tiles by the memory estimate).",
                        choices=("auto", "on", "off"))
    lora_rank: int = _f(0, "LoRA: train low-rank adapters of this rank beside the frozen weights (Hu et al. 2021); "
                           "0 (the default): off, every weight trains (full fine-tuning). 16 is this project's usual "
                           "choice (docs/FINE-TUNING.md).")
    lora_alpha: float = _f(32.0, "LoRA: scale of the adapters' output, alpha / rank. Default 32 (scale 2 at rank 16), "
                                 "between PEFT's LoraConfig default (8) and TRL's PEFT example (16 at rank 32).")
    lora_dropout: float = _f(0.05, "LoRA: dropout on the adapters' input in training. Default 0.05, TRL's PEFT example "
                                   "and QLoRA's for large models.")
    lora_target_modules: str | None = _f(None, "LoRA: comma-separated names of the layers that get adapters (e.g. "
                                               "q_proj,v_proj). Default: the model family's every attention and MLP "
                                               "linear layer (QLoRA's finding), peft's all-linear for other families.")
    load_in_4bit: bool = _f(False, "QLoRA (with --lora_rank): the frozen base's linear layers in 4-bit NF4 with "
                                   "double quantization (bitsandbytes; pip install '.[qlora]'), computed in the run's "
                                   "precision, beside 16-bit adapters: about 0.52 byte a base parameter instead of "
                                   "2 (docs/QLORA.md).")
    model_args: dict | None = _f(None, "A model of your own (--model FILE.py:FUNCTION): its keyword arguments, a "
                                       "mapping in the run file (model_args: {width: 64}) or JSON on the command "
                                       "line, handed to FUNCTION as settings.args (docs/YOUR-MODEL.md).",
                                 parse="mapping")

    def lora_settings(self):
        """config.settings.LoraSettings of these flags, or None where --lora_rank is 0 (full fine-tuning)."""
        if not self.lora_rank:
            return None

        return LoraSettings(rank=self.lora_rank, alpha=self.lora_alpha, dropout=self.lora_dropout,
                            target_modules=parse_target_modules(self.lora_target_modules),
                            load_in_4bit=self.load_in_4bit)


@dataclass(frozen=True)
class DataConfig:
    """What the model reads: the dataset, how it is tokenized and cached, and how blocks are formed."""
    dataset: str | None = _f(None, "What to train on (docs/DATA-PREPARATION.md): a text, JSONL/JSON, Parquet, CSV or "
                                   "Arrow file or a directory of one kind; a save_to_disk directory; a directory "
                                   "prepared by `python -m model_utils.prepare` (its manifest.json); token files "
                                   "(`tokens.npy` or a directory of .npy); a mixture (`a:0.7,b:0.3`, or a JSON file "
                                   "listing parts and weights); a hub dataset name; `embedded` (the text corpus built "
                                   "offline from the Python standard library) or `embedded-chat` (chats about its "
                                   "functions, for fine-tuning); FILE.py:FUNCTION, a dataset of your own "
                                   "(docs/YOUR-MODEL.md). Rows of chat, ShareGPT, prompt/completion, Alpaca or "
                                   "token formats fine-tune (--data_format). Default: `embedded` for a preset; a "
                                   "pretrained model needs one.")
    data_format: str = _f("auto", "What the rows hold (docs/FINE-TUNING.md): chat (messages), sharegpt "
                                  "(conversations of from/value), prompt_completion, alpaca "
                                  "(instruction/input/output), tokens (input_ids, optional labels), text (examples "
                                  "kept apart, loss on all). Fine-tuning formats are packed as examples with loss on "
                                  "the answers. auto (the default): chat, sharegpt, prompt_completion or alpaca from "
                                  "the columns, tokens where a labels column is there, else pretraining text "
                                  "(documents concatenated into blocks).",
                          choices=("auto", "text", "chat", "sharegpt", "prompt_completion", "alpaca", "tokens",
                                   "preference"))
    train_on_prompts: bool = _f(False, "Fine-tuning formats: loss on every token, prompts included. Default off: "
                                       "only the answers (assistant messages, completions, outputs) carry loss.")
    dataset_config_name: str | None = _f(None, "Hub dataset configuration name (e.g. 'en' for allenai/c4).")
    local_dataset: str = _f("auto", "true: DATASET must be a local path; false: a hub name; auto: a path if it exists.",
                            choices=("auto", "true", "false"))
    text_column: str = _f("text", "Column holding the documents' text.")
    validation_fraction: float = _f(0.01, "Fraction of packed blocks held out for validation when the dataset has no "
                                          "'validation' split.")
    data_cache_dir: str | None = _f(None, "Where tokenized/packed data is cached; must be shared by all nodes for "
                                          "multi-node runs to build it once. Default: $DEEPSPEED_LM_CACHE, else "
                                          "$XDG_CACHE_HOME/deepspeed-lm, else ~/.cache/deepspeed-lm.")
    num_proc: int | None = _f(None, "Processes for tokenization (datasets.map; fine-tuning rows from 20,000 on). Default: "
                                      "CPUs available, at most 16.")
    max_documents: int = _f(0, "Use only the first N documents of each split (0: all). Files and hub datasets are then "
                               "streamed: a hub dataset is read as far as those documents, not downloaded whole.")
    streaming: bool = _f(False, "Stream --dataset (a hub dataset, or text/JSONL/Parquet files) instead of downloading "
                                "and tokenizing it whole: each rank reads its own documents and tokenizes them as "
                                "training goes; checkpoints hold each rank's place in the stream, and a resume needs "
                                "the same number of ranks. docs/DATA-PREPARATION.md, Streaming.")
    stream_shuffle_blocks: int = _f(256, "With --streaming: blocks each rank holds in its shuffle buffer, each block "
                                         "read replacing one drawn by a generator of --seed (0: the stream's order). "
                                         "Every checkpoint holds each rank's buffer: blocks x (seq_len + 1) x 4 bytes.")
    document_mask: bool = _f(False, "Attend only within each document of a packed block: positions restart after "
                                    "each EOS and attention stops at it (block-causal, as Megatron's --reset-position-ids "
                                    "--reset-attention-mask). Off: causal attention across the documents of a block.")
    dummy_data: int = _f(0, "Train on N random-token blocks instead of a dataset (smoke test; needs no data).")
    data_args: dict | None = _f(None, "A dataset of your own (--dataset FILE.py:FUNCTION): its keyword arguments, a "
                                      "mapping in the run file or JSON on the command line, handed to FUNCTION as "
                                      "settings.args; a stage's own data_args are merged over them "
                                      "(docs/YOUR-MODEL.md).", parse="mapping")
    data_stale_minutes: float = _f(10.0, "Ranks waiting for another rank to tokenize the data stop with a message "
                                         "when its progress file has not advanced for this long (it died or hangs). "
                                         "The wait itself has no limit.")


@dataclass(frozen=True)
class BatchConfig:
    """How much each optimizer step sees and how many steps run. The global batch is stated once; the
    gradient accumulation is derived from it (config.batch.BatchRequest)."""
    max_steps: int = _f(300, "Optimizer steps to train; also the scheduler's total_num_steps.")
    num_epochs: float | None = _f(None, "Train for this many passes over the training blocks instead of --max_steps "
                                        "(converted to steps at the global batch, stated in the batch line; may be "
                                        "fractional). Default: off, --max_steps sets the length.")
    global_batch_tokens: int | None = _f(None, "Tokens per optimizer step, over all ranks: the global batch, stated once. "
                                               "Accumulation is derived (tokens / (micro-batch x world size x "
                                               "seq_len)), so a run on more or fewer nodes optimises the same way. "
                                               "Overrides train_batch_size. Default: ds_config.json's batch.")
    micro_batch_size: int | str | None = _f(None, "Override train_micro_batch_size_per_gpu: blocks per GPU per "
                                                  "forward/backward, or auto (the largest whose whole run fits the "
                                                  "GPU by the preflight's memory estimate).", parse="micro_batch")
    gradient_accumulation_steps: int | None = _f(None, "Override gradient_accumulation_steps (with "
                                                       "--global_batch_tokens it is derived instead).")


@dataclass(frozen=True)
class OptimConfig:
    """The optimisation: the DeepSpeed config file and the flags that override its values."""
    ds_config: str = _f("ds_config.json", "DeepSpeed configuration file (relative paths: working directory, then "
                                          "repository). --deepspeed_config is the same setting (DeepSpeed's launcher "
                                          "convention).", aliases=("--deepspeed_config",))
    learning_rate: float | None = _f(None, "Override the optimizer's lr.")
    warmup_steps: int | None = _f(None, "Override the scheduler's warmup_num_steps ('auto' in the config means 5% of max_steps).")
    delayed_update_from_step: int = _f(0, "ZeRO with the optimizer offloaded to the CPU: from this optimizer step "
                                          "on, each step's update runs on the host beside the next step's forward and "
                                          "backward, which then take their gradients at the weights before it "
                                          "(ZeRO-Offload's one-step delayed parameter update; the GPU no longer waits "
                                          "for the CPU optimizer). 0: off, every update lands before the next step.")
    max_bad_steps: int = _f(3, "Stop after this many consecutive non-finite losses/gradients (each one is skipped).")


    @property
    def ds_config_path(self) -> Path:
        """--ds_config as found: relative to the working directory, else to the repository."""
        path = Path(self.ds_config)
        if not path.is_absolute() and not path.exists() and (REPO_ROOT / path).exists():
            return REPO_ROOT / path
        return path


@dataclass(frozen=True)
class CheckpointConfig:
    """Where the run keeps its state, how often it saves, how it resumes, and the final export."""
    checkpoint_dir: str = _f("checkpoints", "Directory for step-XXXXXXXX checkpoints, `latest`, metrics.jsonl.")
    checkpoint_freq: int = _f(100, "Save a checkpoint every N steps (0: only at the end and on preemption).")
    checkpoint_minutes: float = _f(0.0, "Also save when N minutes have passed since the last save (or the start), "
                                        "whatever the step time: a job with a time limit loses at most N minutes. "
                                        "0: off. Rank 0's clock decides for all ranks.")
    background_checkpoint: bool = _f(True, "Write checkpoints in the background: training stops only while the state "
                                           "is copied to host memory, and a checkpoint counts once every rank has "
                                           "written it (a crash meanwhile leaves the previous one `latest`). Off by "
                                           "itself where the copy would not fit in the node's memory.")
    keep_last_checkpoints: int = _f(3, "Complete checkpoints to keep (older ones are deleted; 0 keeps all).")
    resume: str = _f("auto", "auto: resume from the newest complete checkpoint in checkpoint_dir; never: start fresh "
                             "(refuses if checkpoints exist).", choices=("auto", "never"))
    force_unlock: bool = _f(False, "Take over CHECKPOINT_DIR/run.lock although its holder looks alive (only when that "
                                   "run is known to be dead; a stale heartbeat, a dead process on this host or the "
                                   "same SLURM job after a requeue are taken over without it).")
    resume_from_checkpoint: str | None = _f(None, "Resume from this checkpoint directory (a step-XXXXXXXX dir, or a "
                                                  "checkpoint_dir holding `latest`).")
    export_dir: str | None = _f(None, "Where the final Hugging Face model is written. Default: CHECKPOINT_DIR/hf.")
    export: bool = _f(True, "Export a Hugging Face model (safetensors, config, tokenizer) at the end.")
    export_merged: bool = _f(False, "LoRA: export the merged model (adapters added into the weights, loadable by "
                                    "transformers without peft) to EXPORT_DIR/merged beside the adapter "
                                    "(EXPORT_DIR/adapter). Default off: the adapter alone.")


    @property
    def run_dir(self) -> RunDir:
        """Every path under --checkpoint_dir, and the export directory."""
        return RunDir.of(self.checkpoint_dir, self.export_dir)


@dataclass(frozen=True)
class LoggingConfig:
    """Evaluation, metrics sinks, the data-order audit and the sample generated at the end."""
    eval_interval: int = _f(100, "Evaluate every N steps (0: only at the end).")
    eval_iters: int = _f(20, "Validation micro-batches per rank per evaluation.")
    log_interval: int = _f(10, "Log loss, lr, grad norm and throughput every N steps.")
    tensorboard: bool = _f(True, "Also write the metrics as TensorBoard events to CHECKPOINT_DIR/tensorboard (skipped, "
                                 "with a warning, when tensorboard is not installed, or when ds_config enables "
                                 "DeepSpeed's own tensorboard monitor).")
    wandb: bool = _f(False, "Also log the metrics to Weights & Biases (needs `pip install wandb`; WANDB_MODE=offline "
                            "works without network, `wandb sync` uploads later).")
    wandb_project: str | None = _f(None, "W&B project. Default: $WANDB_PROJECT, else deepspeed-lm.")
    trace_data: bool = _f(False, "Audit the data order: every rank appends the block indices it reads each step to "
                                 "CHECKPOINT_DIR/data_trace/rank-NNNNN.jsonl.")
    generate_prompt: str | None = _f(None, "After training, print text the model generates from this prompt.")


@dataclass(frozen=True)
class PreferenceConfig:
    """Preference tuning on pairs of a better and a worse answer (docs/PREFERENCE.md); config/preference.py resolves
    and checks these."""
    preference: str = _f("off", "Tune on preference pairs (rows of prompt, chosen, rejected) with this objective: dpo "
                                "(DPO's sigmoid loss), ipo, simpo or orpo (SimPO and ORPO need no reference model). "
                                "off: the data train as they are.", choices=("off", "dpo", "ipo", "simpo", "orpo"))
    beta: float | None = _f(None, "The objective's beta: DPO's and IPO's strength of the reference, SimPO's reward "
                                  "scale, ORPO's lambda (the weight of its odds-ratio term). Default: 0.1 (TRL's), "
                                  "2.0 for SimPO (its paper's).")
    simpo_gamma: float | None = _f(None, "SimPO's target reward margin gamma. Default 0.5 (TRL's CPOConfig).")


@dataclass(frozen=True)
class VisionConfig:
    """Vision-language models (docs/VISION.md): what trains, and how many tokens an image becomes."""
    freeze: str | None = _f(None, "The parts of a vision-language model that do not train, comma-separated among "
                                  "vision_tower, projector and language_model, or none. Default: vision_tower for a "
                                  "pretrained model (the projector and the language model train, as Qwen's and "
                                  "ms-swift's fine-tuning defaults), none for a preset trained from random weights.")
    vision_tower_lr: float | None = _f(None, "The vision tower's learning rate where it trains (Qwen's "
                                             "vision_tower_lr, ms-swift's vit_lr), following the schedule as the "
                                             "language model's does. Default: the language model's.")
    projector_lr: float | None = _f(None, "The projector's learning rate (Qwen's mm_projector_lr, ms-swift's "
                                          "aligner_lr). Default: the language model's.")
    max_image_pixels: int | None = _f(None, "The most pixels an image is resized to (the Qwen-VL family's max_pixels; "
                                            "28 x 28 pixels make one image token). Default: as many as keep one "
                                            "image within a quarter of --seq_len, at most the processor's own.")
    min_image_pixels: int | None = _f(None, "The fewest pixels an image is resized to (min_pixels). Default: the "
                                            "processor's own.")


@dataclass(frozen=True)
class CurriculumConfig:
    """A curriculum: stages run in order in one run (docs/YOUR-MODEL.md, Stages); config/stages.py reads them."""
    stages: list | None = _f(None, "The run's stages in order, a list in the run file (stages: [{name: align, steps: "
                                   "100, learning_rate: 1e-3, train: [projector]}, ...]) or JSON on the command line; "
                                   "each with its length (steps or epochs), its learning rate (and warmup_steps), "
                                   "what trains (train: or freeze: module prefixes or your model's groups) and its "
                                   "own data_args. Default: one stage, the whole run.", parse="stage_list")


# The section each flag belongs to: the command line stays flat, the configuration is a tree.
SECTIONS = {"model": ModelConfig, "data": DataConfig, "batch": BatchConfig, "optim": OptimConfig,
            "checkpoint": CheckpointConfig, "logging": LoggingConfig, "speed": SpeedConfig,
            "preference": PreferenceConfig, "vision": VisionConfig, "curriculum": CurriculumConfig}


@dataclass(frozen=True)
class TrainConfig:
    """The whole configuration: one section per concern, each handed to the modules that need it."""

    model: ModelConfig = field(default_factory=ModelConfig, metadata={"section": True})
    data: DataConfig = field(default_factory=DataConfig, metadata={"section": True})
    batch: BatchConfig = field(default_factory=BatchConfig, metadata={"section": True})
    optim: OptimConfig = field(default_factory=OptimConfig, metadata={"section": True})
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig, metadata={"section": True})
    logging: LoggingConfig = field(default_factory=LoggingConfig, metadata={"section": True})
    speed: SpeedConfig = field(default_factory=SpeedConfig, metadata={"section": True})
    preference: PreferenceConfig = field(default_factory=PreferenceConfig, metadata={"section": True})
    vision: VisionConfig = field(default_factory=VisionConfig, metadata={"section": True})
    curriculum: CurriculumConfig = field(default_factory=CurriculumConfig, metadata={"section": True})
    seed: int = _f(1234, "Seed for initialisation and data order.")
    # ----- modes -----
    preflight: bool = _f(False, "Check configuration, data, tokenizer, model and checkpoints, print the plan, exit 0 or 2.")
    sanity_check: bool = _f(False, "Instead of training, all-reduce test tensors on every rank and report bus bandwidth.")
    # The flags given on the command line (not filled by parse_args' defaults).
    explicit: frozenset = field(default=frozenset(), metadata={"internal": True})

    @classmethod
    def from_flags(cls, explicit: frozenset = frozenset(), **flags) -> TrainConfig:
        """A configuration from flat flag values (as the command line names them); unnamed ones keep their
        defaults."""
        parts: dict[str, dict] = {name: {} for name in SECTIONS}
        given = {name: flags.pop(name) for name, section in SECTIONS.items()  # whole sections, e.g. speed=...
                 if isinstance(flags.get(name), section)}
        top = {}
        for key, value in flags.items():
            section = FLAG_SECTION.get(key)
            if section is None:
                top[key] = value
            else:
                parts[section][key] = value
        sections = {name: given.get(name) or SECTIONS[name](**values) for name, values in parts.items()}
        return cls(**sections, **top, explicit=explicit)

    def flag(self, name: str):
        """One setting by its flag name."""
        section = FLAG_SECTION.get(name)
        return getattr(getattr(self, section) if section else self, name)

    def with_flags(self, **flags) -> TrainConfig:
        """This configuration with some flags changed (a what-if of the preflight)."""
        changed = {name: dataclasses.replace(getattr(self, name),
                                              **{k: v for k, v in flags.items() if FLAG_SECTION.get(k) == name})
                   for name in SECTIONS if any(FLAG_SECTION.get(k) == name for k in flags)}
        return dataclasses.replace(self, **changed, **{k: v for k, v in flags.items() if k not in FLAG_SECTION})

    def flags(self) -> dict:
        """Every setting by flag name, the speed options as a `speed` dict: what the run header, W&B and summary.json
        record."""
        values = {}
        for name in SECTIONS:
            section = getattr(self, name)
            if name == "speed":
                values["speed"] = section.as_dict()
            else:
                values.update(dataclasses.asdict(section))
        values.update(seed=self.seed, preflight=self.preflight, sanity_check=self.sanity_check)
        return values


FLAG_SECTION = {f.name: name for name, section in SECTIONS.items() for f in dataclasses.fields(section)}


def flag_fields(settings_class) -> list[dataclasses.Field]:
    """The fields of a settings class that are flags: neither a section nor internal."""
    return [f for f in dataclasses.fields(settings_class)
            if not f.metadata.get("internal") and not f.metadata.get("section")]


@dataclass
class LoraSettings:
    """LoRA's settings (--lora_rank, --lora_alpha, --lora_dropout, --lora_target_modules, --export_merged).

    Defaults: rank 16 and alpha 32 (the adapters' scale alpha / rank = 2), this project's choice between PEFT's own
    LoraConfig defaults (r=8, alpha=8, dropout 0) and TRL's PEFT example (r=32, alpha=16); dropout 0.05 as in TRL's
    PEFT example and QLoRA's for large models."""

    rank: int = 16
    """Inner dimension r of each adapter: trainable parameters per adapted layer are r x (in + out)."""
    alpha: float = 32.0
    """Scale of the adapters' output: B A x is multiplied by alpha / rank, so alpha sets the update's size
    independently of the rank (raising the rank with alpha fixed keeps the learning rate's effect)."""
    dropout: float = 0.05
    """Dropout on the adapters' input during training (0 turns it off; the frozen path never drops)."""
    target_modules: tuple[str, ...] | None = None
    """Names (last component) of the layers that get adapters; None: the model family's default
    (DEFAULT_TARGET_MODULES, else every linear layer but the output head)."""
    export_merged: bool = False
    """Export also the merged model (adapters added into the weights), loadable by transformers without peft."""
    load_in_4bit: bool = False
    """QLoRA: the frozen base's linear layers stored in 4-bit NF4 (models.quantization); the adapters stay 16-bit."""
    vision_frozen: tuple[str, ...] | None = None
    """A vision-language model's frozen parts (models.vision.parts): the adapters go on its language model only, and
    its other parts that train are trained whole. None: a text model."""

    def problems(self) -> list[Problem]:
        """What is wrong with the values themselves (before any model is built)."""
        problems = []
        if not isinstance(self.rank, int) or self.rank < 1:
            problems.append(Problem("--lora_rank", self.rank, "must be a positive integer", "use e.g. 8, 16 or 64"))
        if not self.alpha > 0:
            problems.append(Problem("--lora_alpha", self.alpha, "must be positive", "use e.g. twice the rank"))
        if not 0 <= self.dropout < 1:
            problems.append(Problem("--lora_dropout", self.dropout, "must be in [0, 1)", "use e.g. 0.05, or 0"))
        if self.target_modules is not None and not self.target_modules:
            problems.append(Problem("--lora_target_modules", "", "names no layer",
                                    "leave it out for the model family's default, or name layers (q_proj,v_proj)"))
        return problems

    def as_manifest(self) -> dict:
        """The settings as a checkpoint manifest records them (what a resume and an export rebuild the model with)."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}

    @classmethod
    def from_manifest(cls, recorded: dict) -> LoraSettings:
        fields = dict(recorded)
        for name in ("target_modules", "vision_frozen"):
            if fields.get(name) is not None:
                fields[name] = tuple(fields[name])
        return cls(**fields)


def parse_target_modules(value: str | None) -> tuple[str, ...] | None:
    """--lora_target_modules "q_proj,v_proj" -> ("q_proj", "v_proj"); empty or "auto": None (the family default)."""
    if value is None or value.strip() in ("", "auto"):
        return None
    return tuple(name.strip() for name in value.split(",") if name.strip())


def micro_batch(text: str) -> int | str:
    """--micro_batch_size: a positive count of blocks, or auto."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither a whole number of blocks nor auto") from None


def layer_count(text: str) -> int | str:
    """--checkpointed_layers: all, auto, or a count of decoder layers."""
    if text in ("all", "auto"):
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither a whole number of layers nor all or auto") from None


ROPE_TYPES = ("linear", "yarn")  # transformers' rope types that train (dynamic scales at inference only)


def rope_scaling(text: str) -> str:
    """--rope_scaling: TYPE:FACTOR, TYPE one of ROPE_TYPES and FACTOR a number above 1 (kept as written)."""
    kind, _, factor = text.partition(":")
    try:
        ok = kind in ROPE_TYPES and float(factor) > 1
    except ValueError:
        ok = False
    if not ok:
        raise argparse.ArgumentTypeError(f"{text!r} is not TYPE:FACTOR with TYPE one of {', '.join(ROPE_TYPES)} and "
                                          "FACTOR above 1 (e.g. yarn:4)")
    return text


def structure(kind: type, text):
    """A mapping or list given as JSON on the command line (a run file gives it as YAML: flags.py passes it as JSON)."""
    import json

    if isinstance(text, kind):
        return text
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, kind):
        example = '{"width": 64}' if kind is dict else '[{"name": "align", "steps": 100}]'
        raise argparse.ArgumentTypeError(f"{text!r} is not a JSON {'mapping' if kind is dict else 'list'} (e.g. "
                                          f"{example}; a run file writes it as YAML)")
    return value


def mapping(text) -> dict:
    """--model_args, --data_args: a JSON mapping."""
    return structure(dict, text)


def stage_list(text) -> list:
    """--stages: a JSON list of stages (config/stages.py checks each)."""
    return structure(list, text)


PARSERS = {"micro_batch": micro_batch, "layer_count": layer_count, "rope_scaling": rope_scaling, "mapping": mapping,
           "stage_list": stage_list}
