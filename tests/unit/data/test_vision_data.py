"""Rows with images: both layouts read into one form, bad rows refused with their row and fix, each image token
expanded into the processor's tokens for that image, the Qwen-VL family's positions equal to the model's own, examples
packed whole with their images, and a micro-batch's pixels read back for exactly its image tokens."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

from model_utils.data.errors import DataError
from model_utils.data.sft.formats import IGNORE_INDEX
from model_utils.data.vision.encode import VisionEncoder, mrope_positions
from model_utils.data.vision.formats import row_messages, vision_format
from model_utils.data.vision.images import ImageFiles
from model_utils.data.vision.packing import PackedVisionExamples, PixelReader, pack_vision_examples
from model_utils.data.vision.processor import (IMAGE_PAD, VISION_END, VISION_START, image_pixels, image_token,
                                               preset_processor, set_image_pixels)


@pytest.fixture(scope="module")
def processor():
    return preset_processor()


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """Two images (red 56 x 56: 4 tokens; blue 112 x 84: 12 tokens) beside the rows that name them."""
    path = tmp_path_factory.mktemp("rows")
    Image.new("RGB", (56, 56), (220, 20, 20)).save(path / "red.png")
    Image.new("RGB", (112, 84), (20, 60, 220)).save(path / "blue.png")
    (path / "broken.png").write_bytes(b"not an image")
    return path


def chat_row(images, text="What colour is it?", answer="Red."):
    return {"messages": [{"role": "user", "content": [*({"type": "image"} for _ in images),
                                                      {"type": "text", "text": text}]},
                         {"role": "assistant", "content": [{"type": "text", "text": answer}]}], "images": images}


def encoder(processor, folder, fmt="chat"):
    return VisionEncoder(processor, fmt, ImageFiles(str(folder), folder / "store"), source="rows.jsonl")


def test_trl_and_llava_layouts_read_as_the_same_conversation(folder):
    trl = chat_row(["red.png"], "Describe it.")
    llava = {"conversations": [{"from": "human", "value": "<image>Describe it."}, {"from": "gpt", "value": "Red."}],
             "image": "red.png"}
    assert row_messages(trl, "chat", 1, "s") == row_messages(llava, "sharegpt", 1, "s")
    tag_in_text = {"messages": [{"role": "user", "content": "<image>Describe it."},
                                {"role": "assistant", "content": "Red."}], "images": ["red.png"]}
    assert row_messages(tag_in_text, "chat", 1, "s")[0] == row_messages(trl, "chat", 1, "s")[0]
    assert vision_format(["messages", "images"], "auto", "s") == "chat"
    assert vision_format(["conversations", "image"], "auto", "s") == "sharegpt"


@pytest.mark.parametrize("row, message, fix", [
    (chat_row(["red.png", "blue.png"]) | {"images": ["red.png"]}, "names 2 image(s) in its conversation but holds 1",
     "one image in `images` per image part"),
    ({"conversations": [{"from": "human", "value": "<image><image>Hi"}, {"from": "gpt", "value": "Yes."}],
      "image": "red.png"}, "names 2 image(s)", "per <image> tag"),
    (chat_row(["red.png"]) | {"messages": [{"role": "user", "content": [{"type": "image"}]}]},
     "has no assistant", "add the answer"),
    (chat_row(["missing.png"]), "names the image missing.png, which is not a file (relative paths are read from",
     "fix the path"),
    (chat_row(["https://example.org/a.png"]), "a URL: training reads local files only", "download the images"),
    (chat_row(["broken.png"]), "cannot be read as an image", "replace the file"),
])
def test_a_bad_row_is_refused_with_its_row_and_fix(processor, folder, row, message, fix):
    fmt = "sharegpt" if "conversations" in row else "chat"
    with pytest.raises(DataError) as caught:
        encoder(processor, folder, fmt).encode(row, 7)
    problem = caught.value.problem
    assert problem.value == "rows.jsonl, row 7" and message in problem.message and fix in problem.fix


def test_each_image_token_becomes_its_images_tokens_and_carries_no_loss(processor, folder):
    example = encoder(processor, folder).encode(chat_row(["red.png", "blue.png"], answer="Purple."), 1)
    token = image_token(processor)[1]
    assert example.image_tokens == [4, 12]  # 56 x 56 -> 2 x 2 merged patches; 112 x 84 -> 4 x 3
    assert sum(t == token for t in example.ids) == 16
    assert all(label == IGNORE_INDEX for t, label in zip(example.ids, example.labels) if t == token)
    answer = processor.tokenizer.decode([t for t, label in zip(example.ids, example.labels) if label != IGNORE_INDEX])
    assert answer == "Purple." + processor.tokenizer.eos_token
    text_only = encoder(processor, folder).encode({"messages": chat_row([])["messages"], "images": []}, 2)
    assert text_only.images == [] and token not in text_only.ids and text_only.mrope.shape == (3, len(text_only.ids))


def qwen3_vl():
    """(processor, config) of a tiny Qwen3-VL: the shipped tokenizer with the vision tokens, Qwen3-VL's image
    processor settings (16-pixel patches: 32 pixels a token side), interleaved mRoPE sections."""
    from transformers import Qwen3VLConfig

    processor = preset_processor("Qwen2VLImageProcessor", "Qwen3VLProcessor")
    images = processor.image_processor
    images.patch_size, images.image_mean, images.image_std = 16, [0.5] * 3, [0.5] * 3
    images.size = {"shortest_edge": 32 * 32, "longest_edge": 256 * 256}
    tokens = processor.tokenizer.convert_tokens_to_ids([VISION_START, VISION_END, IMAGE_PAD])
    config = Qwen3VLConfig(
        text_config=dict(vocab_size=-(-len(processor.tokenizer) // 64) * 64, hidden_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         rope_parameters={"rope_type": "default", "rope_theta": 10_000.0, "mrope_section": [2, 3, 3],
                                          "mrope_interleaved": True}),
        vision_config=dict(depth=2, hidden_size=32, num_heads=2, out_hidden_size=64, num_position_embeddings=64),
        **dict(zip(("vision_start_token_id", "vision_end_token_id", "image_token_id"), tokens)))
    return processor, config


@pytest.mark.parametrize("family", ["qwen2.5-vl", "qwen3-vl"])
def test_multimodal_positions_are_the_models_own(processor, folder, family):
    """Each example's positions in a packed block as the model's own get_rope_index gives them for that example
    alone, with the grids the block's pixels come with: Qwen2.5-VL's, and Qwen3-VL's (its interleaved sections
    only change how the rotary embedding reads the three rows, and its timestamps are a video's)."""
    import torch
    from transformers import AutoModelForImageTextToText

    from model_utils.models.vision.build import vision_model_config

    if family == "qwen3-vl":
        processor, config = qwen3_vl()
    else:
        config = vision_model_config("tiny-vl", processor)
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config)
    rows = [chat_row(["red.png", "blue.png"]), {"messages": chat_row([])["messages"]},
            chat_row(["blue.png"], text="And this one, is it red too?", answer="Blue.")]
    examples = [encoder(processor, folder).encode(row, n) for n, row in enumerate(rows, start=1)]
    token = config.image_token_id
    packed = pack_vision_examples(examples, 160, 0, len(processor.tokenizer), token, "rows.jsonl")
    assert packed.stats.blocks == 1 and packed.stats.images == 3  # the three examples in one block, then padding
    data = PackedVisionExamples(packed.inputs, packed.targets, packed.positions, packed.mrope, packed.images,
                                packed.block_images, packed.image_files, 160, token, PixelReader(processor))
    arrays = data.batch([0]).model_arrays()
    positions, grids = torch.from_numpy(arrays["position_ids"][:, 0]), torch.from_numpy(arrays["image_grid_thw"])
    starts = [*torch.nonzero(positions[0] == 0).flatten().tolist(), 160]  # where each example (and the padding) starts
    for start, end in list(zip(starts, starts[1:]))[:len(examples)]:
        ids = torch.from_numpy(arrays["input_ids"][:, start:end]).long()
        is_image = ids[0] == token
        images = int(is_image[0]) + int((is_image[1:] & ~is_image[:-1]).sum())  # each image's tokens are one run
        expected, _ = model.model.get_rope_index(ids, is_image[None].int(),
                                                 image_grid_thw=grids[:images] if images else None)
        grids = grids[images:]
        assert torch.equal(expected[:, 0], positions[1:, start:end]), (family, start)
    assert len(grids) == 0
    assert np.array_equal(mrope_positions([5, 6], 99, [], 2), [[0, 1]] * 3)


def test_examples_pack_whole_with_their_images_and_read_back_their_pixels(processor, folder):
    rows = [chat_row(["red.png"]), chat_row(["blue.png"], answer="Blue."), {"messages": chat_row([])["messages"]}]
    examples = [encoder(processor, folder).encode(row, n) for n, row in enumerate(rows, start=1)]
    token = image_token(processor)[1]
    packed = pack_vision_examples(examples, 64, 0, len(processor.tokenizer), token, "rows.jsonl")
    assert packed.stats.examples == 3 and packed.stats.images == 2 and packed.stats.image_tokens == 16
    data = PackedVisionExamples(packed.inputs, packed.targets, packed.positions, packed.mrope, packed.images,
                                packed.block_images, packed.image_files, 64, token, PixelReader(processor))
    for block in range(data.num_blocks):
        batch = data.batch([block])
        arrays = batch.model_arrays()
        tokens = int((batch.input_ids == token).sum())
        assert arrays["position_ids"].shape == (4, 1, 64)  # the 1-D positions that mark the examples, then mRoPE
        assert np.array_equal(arrays["position_ids"][0], batch.position_ids)
        if tokens:
            assert int(arrays["image_grid_thw"].prod(axis=1).sum()) == 4 * tokens == arrays["pixel_values"].shape[0]
            assert batch.patches == [int(p) for p in arrays["image_grid_thw"].prod(axis=1)]
        else:
            assert "pixel_values" not in arrays


def test_an_image_cut_by_the_block_is_refused_with_its_row(processor, folder):
    late_image = {"conversations": [{"from": "human", "value": "word " * 40 + "<image>"},
                                    {"from": "gpt", "value": "Blue."}], "image": "blue.png"}
    long = encoder(processor, folder, "sharegpt").encode(late_image, 5)
    with pytest.raises(DataError) as caught:
        pack_vision_examples([long], 24, 0, len(processor.tokenizer), image_token(processor)[1], "rows.jsonl")
    assert caught.value.problem.value == "rows.jsonl, row 5"
    assert "raise --seq_len, lower --max_image_pixels" in caught.value.problem.fix
    text_long = encoder(processor, folder).encode({"messages": chat_row([], text="word " * 40)["messages"]}, 6)
    packed = pack_vision_examples([text_long], 24, 0, len(processor.tokenizer), image_token(processor)[1], "r")
    assert packed.stats.truncated == 1  # a long example without images is cut, as text examples are


def test_the_pixel_bounds_set_the_tokens_of_an_image(folder):
    processor = preset_processor()
    files = ImageFiles(str(folder), folder / "store")
    Image.new("RGB", (448, 448)).save(folder / "large.png")
    before = VisionEncoder(processor, "chat", files).encode(chat_row(["large.png"]), 1).image_tokens
    assert set_image_pixels(processor, 112 * 112, None) and image_pixels(processor)[1] == 112 * 112
    after = VisionEncoder(processor, "chat", files).encode(chat_row(["large.png"]), 1).image_tokens
    assert before == [256] and after == [16]


def test_the_processor_saves_and_loads_as_transformers_does(processor, tmp_path):
    from model_utils.data.vision.processor import load_processor

    processor.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "processor_config.json").read_text())
    assert config["processor_class"] == "Qwen2_5_VLProcessor"
    loaded = load_processor(str(tmp_path), "qwen2_5_vl")
    assert image_token(loaded) == image_token(processor) == (IMAGE_PAD, processor.tokenizer.convert_tokens_to_ids(IMAGE_PAD))
    image = Image.new("RGB", (84, 56))
    assert np.array_equal(loaded.image_processor(images=[image])["pixel_values"],
                          processor.image_processor(images=[image])["pixel_values"])
