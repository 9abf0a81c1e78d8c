"""The trainer's package: one folder per concern, each layer importing only the ones below it.

    train/      the loop (loop.py, read top to bottom), one optimizer step, building a run from its plan, resuming
    planning/   configuration -> the frozen plan of a run (memory model and its choices), and the preflight's checks
    models/     model configs built or loaded, the memory estimate, LoRA, speed options, evaluation loss, export;
                vision-language models (vision/), a model of your own's contract (custom/)
    data/       what --dataset names, loading, tokenizing, packing, the deterministic order, preparation, streams,
                mixtures, fine-tuning examples (sft/), images (vision/), a dataset of your own (custom/), the
                embedded corpora and tokenizer
    runtime/    one process of a run: process group, per-rank state and signals, the run lock, logs, metric sinks
    checkpoint/ the checkpoint protocol: complete-only saves, background writes, resume points, retention
    config/     the settings: typed sections, flags, their checks, presets, ds_config.json and the batch
    patches/    every place that reaches below a library's public API, version-gated (apart: imports core only)
    core/       Problem and ConfigError, exit statuses, the run directory's names, the seam that imports your
                FILE.py:FUNCTION (user_code.py): imports nothing of the project

The modules at this level are commands, run as `python -m model_utils.NAME`: prepare (tokenize a corpus ahead of
training), export (a checkpoint to a Hugging Face directory), generate (text from an export), plot (a run's metrics).
Training itself starts at src/train_deepspeed.py.
"""
