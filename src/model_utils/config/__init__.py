"""The settings, above core: what a run is asked to do, checked before anything heavy loads.

settings.py holds one typed dataclass per concern (model, data, batch, optimisation, checkpoints, logging, speed) and
the LoRA settings; flags.py turns them into the command line; hf_names.py answers Hugging Face Trainer's flag names
(taken or refused); run_file.py reads a --config file of flags and writes a run's own; checks.py validates the
settings (every problem at once); presets.py names the model presets; fine_tuning.py turns --num_epochs into steps
and sets the fine-tuning defaults; deepspeed.py loads ds_config.json and resolves its "auto" values; batch.py settles
micro-batch, accumulation and global batch; known_keys.py finds misspelt DeepSpeed keys. Imports core and patches
only (no torch; pyyaml for the config file).
"""
