"""The vision tower's and the projector's FLOPs, added to the language model's for MFU (models.build.FlopsModel counts
the language model alone).

By the convention FlopsModel follows: a part that trains costs 6 FLOPs per parameter per input it sees (forward,
and the backward for activations and weights), a frozen part 2 (its forward only: nothing upstream of the tower
trains, so no backward runs through it); the tower sees every patch, the projector every image token; the tower's
attention covers each image's full patch square (4 or 12 FLOPs per query-key pair, layer and channel; Qwen2.5-VL's
windowed layers compute less, so its MFU is a little understated).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class VisionFlops:
    tower_params: int
    projector_params: int
    tower_layers: int
    tower_hidden: int
    tower_trains: bool
    projector_trains: bool

    @classmethod
    def of(cls, config, counts: dict[str, int], frozen: tuple[str, ...]) -> VisionFlops:
        vision = config.vision_config
        layers = getattr(vision, "depth", None) or getattr(vision, "num_hidden_layers", 0)
        hidden = getattr(vision, "hidden_size", None) or getattr(vision, "embed_dim", 0)
        return cls(counts["vision_tower"], counts["projector"], int(layers), int(hidden),
                   "vision_tower" not in frozen, "projector" not in frozen)

    def flops(self, patches: list[int], image_tokens: int) -> float:
        """FLOPs of a micro-batch's images: `patches` each image's patches, `image_tokens` their tokens in all."""
        tower = 6 if self.tower_trains else 2
        attention = (12 if self.tower_trains else 4) * self.tower_layers * self.tower_hidden * sum(p * p for p in patches)
        return (tower * self.tower_params * sum(patches) + attention
                + (6 if self.projector_trains else 2) * self.projector_params * image_tokens)
