"""An axolotl plugin (loaded by axolotl from the config's `plugins:` list, in axolotl's environment) that hands
sft_peers.worker_axolotl's step timer and micro-batch counter to the trainer axolotl builds, and the trainer back."""

from __future__ import annotations

from axolotl.integrations.base import BasePlugin

ATTACH: dict = {}  # timer and counter set by the worker before training; the trainer set here for it after


class StepTiming(BasePlugin):
    """The timer as a callback of axolotl's trainer, the counter as a forward pre-hook of its model."""

    def add_callbacks_post_trainer(self, cfg, trainer):
        ATTACH["trainer"] = trainer
        trainer.model.register_forward_pre_hook(ATTACH["counter"], with_kwargs=True)
        return [ATTACH["timer"]]
