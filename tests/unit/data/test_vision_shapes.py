"""The embedded vision-language dataset: pictures of coloured shapes, questions about their colour, kind and count,
pairs of pictures and rows without one, built the same on every run."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pyarrow.json
import pytest
from PIL import Image

from model_utils.data.vision.shapes import (BACKGROUNDS, DEFAULT_MAX_EXAMPLES, FACTS, PALETTE, QUESTIONS, SIZES,
                                            answer_of, build_vision_corpus, question_kind, select_examples,
                                            split_files)

SMALL = 160


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return build_vision_corpus(tmp_path_factory.mktemp("vision"), SMALL)


def rows(corpus: Path, split: str) -> list[dict]:
    return [json.loads(line) for line in open(split_files(corpus)[split], encoding="utf-8")]


def all_rows(corpus: Path) -> list[dict]:
    return rows(corpus, "train") + rows(corpus, "validation")


def images_of(corpus: Path, row: dict) -> list[Image.Image]:
    """The row's pictures, their paths taken relative to the JSONL file's directory."""
    return [Image.open(Path(split_files(corpus)["train"]).parent / path) for path in row.get("images") or []]


def file_hashes(corpus: Path) -> dict[str, str]:
    return {str(path.relative_to(corpus)): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(corpus.rglob("*")) if path.is_file()}


def shapes_in(image: Image.Image) -> list[tuple[int, float]]:
    """(pixels, share of its bounding box filled) of each 4-connected blob of pixels off the background."""
    width, height = image.size
    pixels = image.load()
    background = pixels[0, 0] if pixels[0, 0] in BACKGROUNDS else None
    seen, blobs = set(), []
    for start in ((x, y) for y in range(height) for x in range(width)):
        if start in seen or pixels[start] == background:
            continue
        stack, blob = [start], []
        seen.add(start)
        while stack:
            x, y = stack.pop()
            blob.append((x, y))
            for near in ((x + 1, y), (x - 1, y), (x, y + 1), (x, y - 1)):
                if 0 <= near[0] < width and 0 <= near[1] < height and near not in seen and pixels[near] != background:
                    seen.add(near)
                    stack.append(near)
        xs, ys = [x for x, _ in blob], [y for _, y in blob]
        blobs.append((len(blob), len(blob) / ((max(xs) - min(xs) + 1) * (max(ys) - min(ys) + 1))))
    return blobs


def test_a_few_thousand_examples_by_default_with_a_twentieth_held_out_and_every_kind_of_question():
    splits = select_examples(DEFAULT_MAX_EXAMPLES)
    examples = splits["train"] + splits["validation"]
    assert 2500 <= len(examples) <= 3500 and 0.03 < len(splits["validation"]) / len(examples) < 0.08
    share = {kind: sum(e.kind == kind for e in examples) / len(examples) for kind in QUESTIONS.keys() | {"text"}}
    assert 0.07 < share["pair"] < 0.13 and 0.07 < share["text"] < 0.13
    assert all(0.2 < share[kind] < 0.33 for kind in ("colour", "kind", "count"))


def test_every_image_resolves_beside_the_jsonl_as_an_rgb_picture_of_the_listed_sizes(corpus):
    assert all(Path(path).is_file() for path in split_files(corpus).values())
    sizes = set()
    for row in all_rows(corpus):
        for image in images_of(corpus, row):
            assert image.format == "PNG" and image.mode == "RGB" and image.size in SIZES
            sizes.add(image.size)
    assert len(sizes) >= 4  # examples of different image-token counts


def test_every_row_has_the_same_json_schema_so_any_datasets_version_reads_it(corpus):
    """pyarrow's JSON reader (the `json` loader of datasets 3) refuses a column that is a string in one row and a list
    in another: the rows without a picture hold their text as parts too."""
    for path in split_files(corpus).values():
        table = pyarrow.json.read_json(path)
        assert table.column_names == ["messages", "images"] and table.num_rows == len(rows(corpus, Path(path).stem))


def test_the_answers_are_what_the_pictures_show(corpus):
    """Colour: the named colour's pixels and no other palette colour; count: that many separate blobs; kind: how much
    of its box each blob fills (a square all of it, a circle about pi/4, a triangle about half)."""
    checked = dict.fromkeys(("colour", "count", "kind"), 0)
    filled = {"Square.": (0.97, 1.0), "Circle.": (0.7, 0.88), "Triangle.": (0.45, 0.65)}
    for row in all_rows(corpus):
        kind, answer = question_kind(row), answer_of(row)
        if kind not in checked:
            continue
        (image,) = images_of(corpus, row)
        colours = {colour for _, colour in image.getcolors()}
        blobs = shapes_in(image)
        assert len(colours) == 2 and len(blobs) in range(1, 5)
        if kind == "colour":
            assert colours & set(PALETTE.values()) == {PALETTE[answer.rstrip(".").lower()]}, (row, colours)
        elif kind == "count":
            assert answer == f"{len(blobs)}."
        else:
            low, high = filled[answer]
            assert all(low <= share <= high for _, share in blobs), (row, blobs)
        checked[kind] += 1
    assert all(count >= 10 for count in checked.values()), checked


def test_pairs_and_rows_without_a_picture_are_well_formed(corpus):
    kinds = {"pair": 0, "text": 0}
    for row in all_rows(corpus):
        kind = question_kind(row)
        user, assistant = row["messages"]
        assert user["role"] == "user" and assistant["role"] == "assistant"
        parts = [part["type"] for part in user["content"]]
        if kind == "pair":
            assert parts == ["image", "image", "text"] and len(row["images"]) == len(set(row["images"])) == 2
            colours = [{c for _, c in image.getcolors()} - set(BACKGROUNDS) for image in images_of(corpus, row)]
            assert answer_of(row) == ("Yes." if colours[0] == colours[1] else "No.")
        elif kind == "text":
            assert parts == ["text"] and row["images"] == []
            assert (user["content"][0]["text"], answer_of(row)) in FACTS
        else:
            assert parts == ["image", "text"] and len(row["images"]) == 1
        kinds[kind] = kinds.get(kind, 0) + 1
    assert kinds["pair"] >= 3 and kinds["text"] >= 3
    with pytest.raises(ValueError):
        question_kind({"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi"}]}]})


def test_every_build_gives_the_same_bytes_and_a_second_call_rewrites_nothing(corpus, tmp_path):
    again = build_vision_corpus(tmp_path, SMALL)
    assert again.name == corpus.name and file_hashes(again) == file_hashes(corpus)
    mtimes = {path: os.stat(path).st_mtime_ns for path in again.rglob("*")}
    assert build_vision_corpus(tmp_path, SMALL) == again
    assert {path: os.stat(path).st_mtime_ns for path in again.rglob("*")} == mtimes


def test_more_examples_keep_the_smaller_builds_examples_and_split(corpus, tmp_path):
    larger = build_vision_corpus(tmp_path, 2 * SMALL)
    assert larger.name != corpus.name
    small_hashes, large_hashes = file_hashes(corpus), file_hashes(larger)
    for split in ("train", "validation"):
        small, large = rows(corpus, split), rows(larger, split)
        assert len(large) >= len(small) and large[:len(small)] == small
        for row in small:
            assert all(small_hashes[path] == large_hashes[path] for path in row["images"])
