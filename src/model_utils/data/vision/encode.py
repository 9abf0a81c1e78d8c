"""Rows with images -> examples: the conversation's tokens with the loss on the answers (data.sft.encode's
ExampleEncoder, through the processor's chat template), each image token expanded into its image's tokens (the
processor's own expansion, one image at a time), and, for the Qwen-VL family, the multimodal rotary positions.

Multimodal RoPE (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): a text token advances all three position rows by one; an image of
t x h x w patches, merged m x m, is a grid of (h/m) x (w/m) tokens at (start, start + row, start + column), after which
the text continues at start + max(h/m, w/m). Computed here per example, they restart with it in a packed block as the
1-D positions do (what the models' own get_rope_index gives one unpacked example: tests/unit/data/test_vision_data.py).
Qwen3-VL places an image's tokens as Qwen2.5-VL does: its interleaved sections change only how its rotary embedding
reads the three rows, and its timestamps split a video into frames (rows hold images only), so one computation serves
the family.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from model_utils.data.sft.encode import ExampleEncoder
from model_utils.data.sft.formats import IGNORE_INDEX, row_problem
from model_utils.data.vision.formats import rendered, row_messages
from model_utils.data.vision.images import ImageFiles, readable_image
from model_utils.data.vision.processor import chat_template_of, image_token


@dataclass
class VisionExample:
    """One example: token ids and their labels, the files of its images in the order of their tokens, each image's
    token count, and the multimodal positions (3 x len(ids)) where the model takes them (else None)."""

    ids: list[int]
    labels: list[int]
    images: list[str]
    image_tokens: list[int]
    mrope: np.ndarray | None
    number: int  # the row, 1-based (the problems name it)


class ImageTokens:
    """An image's tokens as the processor writes them in place of the image token, and its patch grid (t, h, w) where
    the processor gives one (the Qwen-VL family), else None."""

    def __init__(self, processor):
        self.processor = processor
        self.token, self.token_id = image_token(processor)

    def expand(self, image) -> tuple[list[int], tuple[int, int, int] | None]:
        out = self.processor(text=[self.token], images=[image], add_special_tokens=False, return_tensors="np")
        ids = [int(i) for i in out["input_ids"][0]]
        grid = out.get("image_grid_thw")
        return ids, (tuple(int(v) for v in grid[0]) if grid is not None else None)


def mrope_positions(ids: list[int], image_token_id: int, grids: list[tuple[int, int, int]], merge: int) -> np.ndarray:
    """The three rows of multimodal rotary positions of one example (module docstring)."""
    positions = np.zeros((3, len(ids)), dtype=np.int64)
    current, at, grid_index = 0, 0, 0
    while at < len(ids):
        if ids[at] != image_token_id:
            end = at
            while end < len(ids) and ids[end] != image_token_id:
                end += 1
            positions[:, at:end] = np.arange(current, current + end - at)
            current += end - at
            at = end
            continue
        _, h, w = grids[grid_index]
        grid_index += 1
        rows, columns = h // merge, w // merge
        count = rows * columns
        row_index, column_index = np.meshgrid(np.arange(rows), np.arange(columns), indexing="ij")
        positions[0, at:at + count] = current
        positions[1, at:at + count] = current + row_index.ravel()
        positions[2, at:at + count] = current + column_index.ravel()
        current += max(rows, columns)
        at += count
    return positions


class VisionEncoder:
    """Turns rows of one layout (data.vision.formats) into VisionExamples with a model's processor."""

    def __init__(self, processor, fmt: str, files: ImageFiles, train_on_prompts: bool = False, source: str = "dataset"):
        self.fmt, self.files, self.source = fmt, files, source
        self.text = ExampleEncoder(processor.tokenizer, "chat", train_on_prompts, source,
                                   chat_template=chat_template_of(processor))
        self.images = ImageTokens(processor)
        self.merge = getattr(processor.image_processor, "merge_size", None)

    def describe(self) -> str:
        return f"{self.fmt} with images, {self.text.describe().split(', ', 1)[1]}"

    def encode(self, row: dict, number: int) -> VisionExample:
        messages, values = row_messages(row, self.fmt, number, self.source)
        paths = [self.files.path_of(value, self.source, number) for value in values]
        example = self.text.encode_chat(rendered(messages), number)
        token = self.images.token_id
        slots = [i for i, t in enumerate(example.ids) if t == token]
        if len(slots) != len(paths):
            raise row_problem(self.source, number, f"the chat template wrote {len(slots)} image token(s) "
                              f"({self.images.token}) for its {len(paths)} image(s)",
                              "render images with the model's own chat template (the processor's), which writes "
                              "one image token per image part")
        ids, labels, counts, grids, at = [], [], [], [], 0
        for slot, path in zip(slots, paths):
            ids += example.ids[at:slot]
            labels += example.labels[at:slot]
            expansion, grid = self.images.expand(readable_image(path, self.source, number))
            ids += expansion
            labels += [IGNORE_INDEX] * len(expansion)
            counts.append(sum(t == token for t in expansion))
            grids.append(grid)
            at = slot + 1
        ids += example.ids[at:]
        labels += example.labels[at:]
        mrope = None
        if self.merge and all(grid is not None for grid in grids):
            mrope = mrope_positions(ids, token, grids, self.merge)
        return VisionExample(ids, labels, paths, counts, mrope, number)
