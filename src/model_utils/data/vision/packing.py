"""Examples with images packed into blocks, as text examples are (data.sft.packing: whole, best fit by decreasing
length, positions restarting at each example, padding as a segment of its own), with what a block's images need
beside its tokens: the files of its images in the order of their tokens, and the multimodal positions of the Qwen-VL
family (restarting with each example). An example longer than a block keeps its first seq_len + 1 tokens only where
no image's tokens are cut; one whose image would be cut is refused with its row.

A micro-batch's images are read and processed when the step needs them (`VisionBatch.model_arrays`), the vision
tower running once over all of them: the packed data hold token ids, never pixels.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from model_utils.core.problems import Problem
from model_utils.data.errors import DataError, OneRankDataError
from model_utils.data.sft.formats import IGNORE_INDEX
from model_utils.data.sft.packing import ExampleBatch, PackedExamples, PackingStats, best_fit_blocks
from model_utils.data.tokens import token_dtype
from model_utils.data.vision.encode import VisionExample
from model_utils.data.vision.images import open_rgb


@dataclass
class VisionStats(PackingStats):
    """PackingStats with the images: how many, their tokens, the most one example holds."""

    images: int = 0
    image_tokens: int = 0
    most_image_tokens: int = 0  # the most image tokens of one example

    def describe(self) -> str:
        return (super().describe() + f"; {self.images:,} images, {self.image_tokens:,} image tokens "
                f"({100 * self.image_tokens / max(self.tokens, 1):.1f}% of the tokens, at most "
                f"{self.most_image_tokens:,} in one example)")


@dataclass
class PackedVisionArrays:
    """PackedArrays (flat blocks of inputs, targets, positions) with the multimodal positions (3 x positions, or
    empty where the model takes 1-D ones) and the images: `image_files` their paths, `block_images` each block's
    image indices (into image_files) as offsets (num_blocks + 1) into `images`."""

    inputs: np.ndarray
    targets: np.ndarray
    positions: np.ndarray
    mrope: np.ndarray
    images: np.ndarray
    block_images: np.ndarray
    image_files: list[str]
    stats: VisionStats = field(default_factory=VisionStats)


def image_cut_problem(example: VisionExample, seq_len: int, source: str) -> Problem:
    last = max(i for i, t in enumerate(example.labels) if t == IGNORE_INDEX) if example.images else 0
    return Problem("--dataset", f"{source}, row {example.number}",
                   f"holds {len(example.ids):,} tokens ({sum(example.image_tokens):,} of them its images') and a "
                   f"block holds {seq_len + 1:,}: an image's tokens would be cut (the last image ends near token "
                   f"{last:,})", "raise --seq_len, lower --max_image_pixels (fewer tokens an image), or shorten the "
                   "conversation")


def pack_vision_examples(examples: Iterable[VisionExample], seq_len: int, pad_id: int, vocab_size: int,
                         image_token_id: int, source: str) -> PackedVisionArrays:
    """Pack examples with images whole into blocks of seq_len (module docstring)."""
    stats = VisionStats(seq_len=seq_len)
    pieces: list[VisionExample] = []
    mrope_rows = None
    for example in examples:
        n = len(example.ids)
        if n > seq_len + 1:
            image_at = [i for i, t in enumerate(example.ids) if t == image_token_id]
            if image_at and image_at[-1] >= seq_len:  # inputs are the first seq_len tokens of seq_len + 1
                raise DataError(image_cut_problem(example, seq_len, source))
            stats.truncated += 1
        keep = min(n, seq_len + 1)
        targets = np.asarray(example.labels[1:keep])
        if keep < 2 or not (targets != IGNORE_INDEX).any():
            stats.dropped += 1
            continue
        stats.loss_tokens += int((targets != IGNORE_INDEX).sum())
        stats.tokens += keep - 1
        stats.images += len(example.images)
        stats.image_tokens += sum(example.image_tokens)
        stats.most_image_tokens = max(stats.most_image_tokens, sum(example.image_tokens))
        mrope_rows = example.mrope is not None
        pieces.append(example)
    stats.examples = len(pieces)
    layout = best_fit_blocks([min(len(p.ids), seq_len + 1) - 1 for p in pieces], seq_len)
    stats.blocks = len(layout)
    total = len(layout) * seq_len
    inputs = np.full(total, pad_id, dtype=token_dtype(vocab_size))
    targets = np.full(total, IGNORE_INDEX, dtype=np.int32)
    positions = np.zeros(total, dtype=np.uint16 if seq_len <= 1 << 16 else np.int32)
    mrope = np.zeros((3, total) if mrope_rows else (3, 0), dtype=np.int32)
    files: dict[str, int] = {}
    images, block_images = [], [0]
    for block, members in enumerate(layout):
        at = block * seq_len
        for index in members:
            example = pieces[index]
            n = min(len(example.ids), seq_len + 1) - 1
            inputs[at:at + n] = example.ids[:n]
            targets[at:at + n] = example.labels[1:n + 1]
            positions[at:at + n] = np.arange(n)
            if mrope_rows:
                mrope[:, at:at + n] = example.mrope[:, :n]
            images += [files.setdefault(path, len(files)) for path in example.images]
            at += n
        end = (block + 1) * seq_len
        positions[at:end] = np.arange(end - at)
        if mrope_rows:
            mrope[:, at:end] = np.arange(end - at)
        block_images.append(len(images))
    return PackedVisionArrays(inputs, targets, positions, mrope, np.asarray(images, dtype=np.int64),
                              np.asarray(block_images, dtype=np.int64), list(files), stats)


class PixelReader:
    """A micro-batch's images as the model takes them: the processor's image processor over the files, every image
    of the micro-batch in a single call (pixel_values stacked along the first axis, and the Qwen-VL family's grids).
    `submit` reads them in a background thread (decoding and resizing release the GIL), so that the images of the
    next micro-batch are ready when the step takes it."""

    THREADS = 2

    def __init__(self, processor):
        self.image_processor = processor.image_processor
        self.pool = None

    def __call__(self, files: list[str]) -> dict:
        out = self.image_processor(images=[open_rgb(path) for path in files], return_tensors="np")
        return {name: np.asarray(out[name]) for name in ("pixel_values", "image_grid_thw") if name in out}

    def submit(self, files: list[str]):
        if self.pool is None:
            from concurrent.futures import ThreadPoolExecutor

            self.pool = ThreadPoolExecutor(self.THREADS, thread_name_prefix="pixels")
        return self.pool.submit(self, files)


class PackedVisionExamples(PackedExamples):
    """Packed examples with images, read like PackedExamples: `batch(indices)` is a VisionBatch whose arrays carry the
    micro-batch's images, processed by `reader` (set once the processor is known: `with_reader`)."""

    def __init__(self, inputs, targets, positions, mrope, images, block_images, image_files: list[str], seq_len: int,
                 image_token_id: int, reader: PixelReader | None = None):
        super().__init__(inputs, targets, positions, seq_len)
        self.mrope, self.images, self.block_images = mrope, images, block_images
        self.image_files, self.image_token_id, self.reader = image_files, image_token_id, reader

    def with_reader(self, reader: PixelReader) -> PackedVisionExamples:
        self.reader = reader
        return self

    def files_of(self, indices) -> list[str]:
        """The image files of blocks `indices`, in the order of their tokens."""
        return [self.image_files[int(k)] for i in indices
                for k in self.images[self.block_images[int(i)]:self.block_images[int(i) + 1]]]

    def prefetch(self, indices) -> None:
        """Start reading the images of blocks `indices` (a micro-batch the step will take next) in the background;
        `batch` takes them from here, and starts the read itself where no prefetch did."""
        files = self.files_of(indices)
        if files and self.reader is not None:
            self.pending = {**getattr(self, "pending", {}), tuple(int(i) for i in indices): self.reader.submit(files)}

    def batch(self, indices) -> VisionBatch:
        base = super().batch(indices)
        mrope = None
        if self.mrope.shape[1]:
            mrope = np.stack([self.mrope[:, int(i) * self.seq_len:(int(i) + 1) * self.seq_len] for i in indices],
                             axis=1).astype(np.int64)
        files = self.files_of(indices)
        pending = getattr(self, "pending", {}).pop(tuple(int(i) for i in indices), None)
        if pending is None and files and self.reader is not None:  # read in the background until the step needs them
            pending = self.reader.submit(files)
        return VisionBatch(base.input_ids, base.targets, base.position_ids, mrope, files, self.reader,
                           self.image_token_id, pixels=pending)


@dataclass
class VisionBatch(ExampleBatch):
    """An ExampleBatch with its images: the files in the order of their tokens, the multimodal positions (3 x B x T)
    where the model takes them, and the reader that turns the files into the model's pixel inputs."""

    mrope: np.ndarray | None = None
    image_files: list[str] = field(default_factory=list)
    reader: PixelReader | None = None
    image_token_id: int = -1
    patches: list[int] = field(default_factory=list)  # each image's patches, once model_arrays has read them
    image_tokens: int = 0
    pixels: object = None  # the images being read in the background (PixelReader.submit), where prefetched

    def model_arrays(self, document_boundaries: bool = False) -> dict:
        """ExampleBatch's arrays, with the Qwen-VL family's positions as transformers takes packed ones (4 x B x T:
        the 1-D positions that mark the examples, then the three multimodal rows) and the images' pixel inputs.
        The images' token counts are checked against the tokens: an image file changed since it was packed stops
        this rank with the file named (OneRankDataError: the other ranks' micro-batches hold other images), not a
        shape error inside the model."""
        arrays = super().model_arrays(document_boundaries)
        if self.mrope is not None:
            arrays["position_ids"] = np.concatenate([self.position_ids[None], self.mrope], axis=0)
        if self.image_files:
            pixels = self.pixels.result() if self.pixels is not None else self.reader(self.image_files)
            grid = pixels.get("image_grid_thw")
            tokens = int((self.input_ids == self.image_token_id).sum())
            merge = getattr(self.reader.image_processor, "merge_size", None)
            if grid is not None and merge and int(grid.prod(axis=1).sum()) // merge ** 2 != tokens:
                raise OneRankDataError(Problem(
                    "--dataset", ", ".join(self.image_files[:3]), "an image's size differs from what was packed (its "
                    "tokens no longer match)", "keep the images unchanged while the packed data are in use, or remove "
                    "the data cache to pack again"))
            arrays.update(pixels)
            per_image = tokens // len(self.image_files)  # a fixed-size tower: its patches are about its tokens
            self.patches = ([int(p) for p in grid.prod(axis=1)] if grid is not None
                            else [per_image] * len(self.image_files))
            self.image_tokens = tokens
        return arrays

    @property
    def image_count(self) -> int:
        return len(self.image_files)
