"""Helpers for src/train_deepspeed.py: arguments, data packing, models, checkpoints, training utilities."""
