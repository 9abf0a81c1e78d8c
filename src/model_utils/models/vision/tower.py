"""The vision tower on every micro-batch, images or not, so that every rank runs the same collectives.

Under ZeRO-3 a module's parameters are gathered by the ranks that call it: a rank whose micro-batch holds no image
would skip the tower while the others gather its parameters, and the run hangs or aborts (the issue trackers of
Qwen-VL, DeepSpeed and TRL report it; Qwen's scripts fall back to ZeRO-2). The same holds for evaluation. Here a
micro-batch without images runs the tower (and the projector) on one small blank image, at the point of the model's
forward where real images enter (after the token embedding, before the decoder: a forward hook on the input
embedding), and adds its outputs times zero to the embeddings (the projector's features, and Qwen3-VL's deepstack
features, which the model adds in its first decoder layers): the modules run in the same order on every rank, the
loss is the text-only loss exactly, and the projector's gradient from it is zero.
"""

from __future__ import annotations

import torch


class TowerOnEveryBatch:
    """Hooks that run `model`'s vision tower on `blank` (the processor's inputs of a blank image, on the model's
    device) whenever a forward of `outer` (the module the engine calls: the model, or its peft wrapper) gets no
    pixel_values. `runs` counts the forwards that took the blank image."""

    def __init__(self, outer, model, blank: dict):
        self.model, self.blank, self.images, self.runs = model, blank, False, 0
        self.handles = [outer.register_forward_pre_hook(self._see_inputs, with_kwargs=True),
                        model.get_input_embeddings().register_forward_hook(self._add_tower)]

    def _see_inputs(self, module, args, kwargs):
        self.images = kwargs.get("pixel_values") is not None
        return None

    def _add_tower(self, module, args, embeddings):
        if self.images:
            return None
        self.runs += 1
        features = self.model.get_image_features(**self.blank)
        return embeddings + 0.0 * sum(t.float().sum() for t in used_features(features)).to(embeddings.dtype)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def used_features(features) -> list:
    """The tensors of get_image_features' output that the model itself takes (transformers 5): its pooler_output (the
    projector's features, which replace the image tokens' embeddings) and, where the model has them, the deepstack
    features (Qwen3-VL's deepstack mergers' outputs, which it adds to the image tokens' hidden states in its first
    decoder layers: left out, a micro-batch without images would run those mergers' forward but not their backward,
    and ZeRO-3's ranks would trace different modules). An older release's tensor or tuple is taken whole."""
    pooled = getattr(features, "pooler_output", None)
    if pooled is None:
        return output_tensors(features)
    return output_tensors(pooled) + output_tensors(getattr(features, "deepstack_features", None))


def output_tensors(output) -> list:
    """Every tensor of `output` (a tensor, a tuple or list of them per image or per layer, a ModelOutput), taken of
    what the model uses of get_image_features' output (used_features). Only those: a tensor the model leaves unused
    (the tower's last hidden state) would add a backward pass that an image's step has not, and ZeRO-3's ranks would
    trace different modules."""
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, dict):  # transformers' ModelOutput
        output = list(output.values())
    if isinstance(output, (list, tuple)):
        return [t for item in output for t in output_tensors(item)]
    return []


def blank_image_inputs(processor, device) -> dict:
    """The model's image inputs for one blank image of the smallest size the processor keeps (what the tower runs on
    for a micro-batch without images)."""
    from PIL import Image

    from model_utils.data.vision.processor import image_pixels, pixels_per_token

    bounds, per_token = image_pixels(processor), pixels_per_token(processor)
    least = int(per_token ** 0.5) if per_token else 28  # one merged patch: 28 pixels (Qwen2.5-VL), 32 (Qwen3-VL)
    side = max(least, int(bounds[0] ** 0.5) + 1) if bounds else least
    out = processor.image_processor(images=[Image.new("RGB", (side, side))], return_tensors="pt")
    return {name: out[name].to(device) for name in ("pixel_values", "image_grid_thw") if name in out}


def run_tower_on_every_batch(outer, model, processor, device) -> TowerOnEveryBatch:
    """Install the hooks on `outer` (what the engine calls) and on `model` (the transformers model inside it)."""
    return TowerOnEveryBatch(outer, model, blank_image_inputs(processor, device))
