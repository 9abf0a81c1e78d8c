"""The embedded vision-language dataset: small pictures of coloured shapes and short questions about them, drawn
offline.

Each picture (RGB, a white or light-grey background) holds 1 to 4 filled shapes of one kind (circle, square, triangle)
and one of six clearly distinct colours, apart from each other. The pictures come in a few sizes, all multiples of 28
(a Qwen2-VL image processor's patch of 14 merged 2 by 2 covers them in whole grids), so the examples carry different
numbers of image tokens. A row asks the colour, the kind or the count of one picture's shapes; about one row in ten
shows two pictures and asks whether their shapes have the same colour, and one in ten has no picture at all (a fact
about shapes or colours). Every answer is a word or two and a period, which a tiny model learns in a few hundred steps.

Like the embedded chats (`data/chat_corpus.py`), it is built at run time into a cache directory, never committed. Each
example follows from its index alone (its random choices from `seed_of(index)`, its split from the index's digest), so
a build of fewer examples is the first examples of a larger one, with the same split; the pictures are drawn without
antialiasing at integer coordinates and saved without metadata, so every build has the same pixels and, with the same
Pillow build, the same bytes. The directory holds `train.jsonl`, `validation.jsonl` and `images/`; the rows are in
TRL's vision layout, their `images` paths relative to the directory.

    python -m model_utils.data.vision.shapes    # build (once) and print the directory
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
from dataclasses import dataclass
from pathlib import Path

from model_utils.data.corpus import default_cache_root, place_once

VERSION = "1"  # of the generator: raise it whenever a change here changes the pictures or the rows
DEFAULT_MAX_EXAMPLES = 3000
VALIDATION_PERCENT = 5  # of the examples, chosen by the index's digest: the split does not move with max_examples
PAIR_PERCENT = 10  # rows showing two pictures
TEXT_PERCENT = 10  # rows without a picture
SPLITS = ("train", "validation")
SIZES = ((56, 56), (84, 84), (112, 84), (112, 112), (140, 112), (168, 168))  # (width, height), multiples of 28
BACKGROUNDS = ((255, 255, 255), (232, 232, 232))
PALETTE = {"red": (220, 20, 20), "green": (20, 160, 40), "blue": (20, 60, 220), "yellow": (250, 210, 0),
           "purple": (140, 40, 180), "orange": (250, 130, 0)}
KINDS = ("circle", "square", "triangle")
MAX_SHAPES = 4
QUESTIONS = {"colour": "What colour are the shapes?", "kind": "Which shape is drawn?",
             "count": "How many shapes are there?", "pair": "Are the shapes in both pictures the same colour?"}
FACTS = (  # the rows without a picture
    ("How many sides does a triangle have?", "Three."),
    ("How many corners does a square have?", "Four."),
    ("How many sides does a square have?", "Four."),
    ("How many corners does a circle have?", "None."),
    ("What colour do red and yellow make?", "Orange."),
    ("What colour do blue and yellow make?", "Green."),
    ("What colour do red and blue make?", "Purple."),
    ("Which shape has three corners?", "Triangle."),
)
PICTURE_KINDS = ("colour", "kind", "count")  # the questions about one picture, equally often


@dataclass(frozen=True)
class Picture:
    """One image: its size, background, and the shapes' colour, kind and boxes (left, top, side) in pixels."""

    width: int
    height: int
    background: tuple[int, int, int]
    colour: str
    kind: str
    boxes: tuple[tuple[int, int, int], ...]

    def draw(self):
        """The picture, every pixel either the background or the colour (no antialiasing)."""
        from PIL import Image, ImageDraw  # imported where drawn: the preflight's bare checks never draw

        image = Image.new("RGB", (self.width, self.height), self.background)
        pen = ImageDraw.Draw(image)
        fill = PALETTE[self.colour]
        for left, top, side in self.boxes:
            right, bottom = left + side - 1, top + side - 1
            if self.kind == "circle":
                pen.ellipse((left, top, right, bottom), fill=fill)
            elif self.kind == "square":
                pen.rectangle((left, top, right, bottom), fill=fill)
            else:
                pen.polygon(((left + side // 2, top), (right, bottom), (left, bottom)), fill=fill)
        return image


@dataclass(frozen=True)
class Example:
    """One row: its index, split, question kind (colour, kind, count, pair or text), pictures, question and answer."""

    index: int
    split: str
    kind: str
    pictures: tuple[Picture, ...]
    question: str
    answer: str

    def image_names(self) -> list[str]:
        """The pictures' paths relative to the dataset's directory: images/000123.png, and 000123-2.png for a second."""
        return [f"images/{self.index:06d}{'' if n == 0 else f'-{n + 1}'}.png" for n in range(len(self.pictures))]

    def row(self) -> dict:
        """The row in TRL's vision layout: an image part per picture before the question; `images` (empty for a row
        without a picture, whose contents are still lists of parts, so that every row has the same JSON schema)."""
        user = [{"type": "image"} for _ in self.pictures] + [{"type": "text", "text": self.question}]
        return {"messages": [{"role": "user", "content": user},
                             {"role": "assistant", "content": [{"type": "text", "text": self.answer}]}],
                "images": self.image_names()}


def digest(index: int, purpose: str) -> int:
    """A 64-bit number that follows from the index and what it decides, the same on every machine."""
    return int.from_bytes(hashlib.sha256(f"vision-shapes|{purpose}|{index}".encode()).digest()[:8], "big")


def seed_of(index: int) -> int:
    """The seed of the example's random choices (`random.Random(seed_of(index))`, never the global generator)."""
    return digest(index, "pictures")


def split_of(index: int) -> str:
    """validation for VALIDATION_PERCENT of the indices, by their digest alone."""
    return "validation" if digest(index, "split") % 100 < VALIDATION_PERCENT else "train"


def kind_of(index: int) -> str:
    """The question an example asks: text, pair or one of PICTURE_KINDS, by the index's digest."""
    value = digest(index, "kind")
    if value % 100 < TEXT_PERCENT:
        return "text"
    if value % 100 < TEXT_PERCENT + PAIR_PERCENT:
        return "pair"
    return PICTURE_KINDS[(value // 100) % len(PICTURE_KINDS)]


def place_shapes(rng: random.Random, width: int, height: int, count: int) -> tuple[tuple[int, int, int], ...]:
    """`count` square boxes (left, top, side), each inside its own cell of a 2 or 3 by 2 or 3 grid and 2 pixels from
    the cell's edges: no two touch. A side is between about half the cell and the whole cell less the margins."""
    columns, rows = (2 if width < 112 else 3), (2 if height < 112 else 3)
    cell_width, cell_height = width // columns, height // rows
    largest = min(cell_width, cell_height) - 4
    boxes = []
    for cell in sorted(rng.sample(range(columns * rows), count)):
        side = rng.randint(max(10, largest // 2), largest)
        left = (cell % columns) * cell_width + 2 + rng.randint(0, cell_width - 4 - side)
        top = (cell // columns) * cell_height + 2 + rng.randint(0, cell_height - 4 - side)
        boxes.append((left, top, side))
    return tuple(boxes)


def random_picture(rng: random.Random, colour: str | None = None) -> Picture:
    """A picture of 1 to MAX_SHAPES shapes of one kind, of `colour` or a random one."""
    width, height = rng.choice(SIZES)
    background = rng.choice(BACKGROUNDS)
    colour = colour or rng.choice(sorted(PALETTE))
    kind = rng.choice(KINDS)
    boxes = place_shapes(rng, width, height, rng.randint(1, MAX_SHAPES))
    return Picture(width, height, background, colour, kind, boxes)


def example(index: int) -> Example:
    """The example at `index`: its pictures, question and answer, from the index alone."""
    rng = random.Random(seed_of(index))
    kind, split = kind_of(index), split_of(index)
    if kind == "text":
        question, answer = FACTS[rng.randrange(len(FACTS))]
        return Example(index, split, kind, (), question, answer)
    first = random_picture(rng)
    if kind == "pair":
        same = rng.random() < 0.5
        other = first.colour if same else rng.choice([c for c in sorted(PALETTE) if c != first.colour])
        pictures = (first, random_picture(rng, other))
        answer = "Yes." if same else "No."
    else:
        pictures = (first,)
        answer = {"colour": f"{first.colour.capitalize()}.", "kind": f"{first.kind.capitalize()}.",
                  "count": f"{len(first.boxes)}."}[kind]
    return Example(index, split, kind, pictures, QUESTIONS[kind], answer)


def select_examples(max_examples: int = DEFAULT_MAX_EXAMPLES) -> dict[str, list[Example]]:
    """{split: examples}: the examples at indices 0 to max_examples - 1, each in the split its index's digest says."""
    splits = {split: [] for split in SPLITS}
    for index in range(max_examples):
        chosen = example(index)
        splits[chosen.split].append(chosen)
    return splits


def _place_image(picture: Picture, path: Path) -> None:
    """Draw the picture to a temporary name and put it in place (corpus.place_once); one already there stays (a
    picture is the same on every build)."""
    if path.exists():
        return
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    picture.draw().save(tmp, format="PNG")
    place_once(tmp, path)


def build_vision_corpus(cache_root: Path | None = None, max_examples: int = DEFAULT_MAX_EXAMPLES) -> Path:
    """Build (once) and return the directory holding `train.jsonl`, `validation.jsonl` (one row per line, in TRL's
    vision layout) and `images/`. The key is the generator's version and every setting that shapes the rows; the
    pictures come first and the JSONL files last, each file written to a temporary name and put in place where no other
    process's is (corpus.place_once): a directory with both JSONL files is complete."""
    key = hashlib.sha256(f"{VERSION}|{max_examples}|{VALIDATION_PERCENT}|{PAIR_PERCENT}|{TEXT_PERCENT}|{SIZES}|"
                         f"{BACKGROUNDS}|{PALETTE}|{KINDS}|{MAX_SHAPES}|{QUESTIONS}|{FACTS}".encode()).hexdigest()[:12]
    out_dir = (cache_root or default_cache_root()) / f"vision-shapes-v{VERSION}-{key}"
    if all((out_dir / f"{split}.jsonl").exists() for split in SPLITS):
        return out_dir
    (out_dir / "images").mkdir(parents=True, exist_ok=True)
    splits = select_examples(max_examples)
    for examples in splits.values():
        for chosen in examples:
            for picture, name in zip(chosen.pictures, chosen.image_names()):
                _place_image(picture, out_dir / name)
    for split, examples in splits.items():
        tmp = out_dir / f"{split}.jsonl.tmp-{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as f:
            for chosen in examples:
                f.write(json.dumps(chosen.row(), ensure_ascii=False) + "\n")
        place_once(tmp, out_dir / f"{split}.jsonl")
    return out_dir


def split_files(corpus_dir: Path) -> dict[str, str]:
    """{split: JSONL file} of a built dataset, as `datasets.load_dataset("json", data_files=...)` takes them."""
    return {split: str(Path(corpus_dir) / f"{split}.jsonl") for split in SPLITS}


def _texts(content: str | list[dict]) -> str:
    """A message's text: a plain string, or its text parts joined."""
    if isinstance(content, str):
        return content
    return "".join(part["text"] for part in content if part.get("type") == "text")


def answer_of(row: dict) -> str:
    """The row's expected answer: its last assistant message's text."""
    return _texts(next(m for m in reversed(row["messages"]) if m["role"] == "assistant")["content"])


def question_kind(row: dict) -> str:
    """What the row asks: colour, kind, count (of one picture), pair (two pictures) or text (no picture), for scoring
    held-out accuracy per kind. A question this module does not ask raises ValueError."""
    content = next(m for m in row["messages"] if m["role"] == "user")["content"]
    images = 0 if isinstance(content, str) else sum(part.get("type") == "image" for part in content)
    if images == 0:
        return "text"
    if images == 2:
        return "pair"
    kinds = {question: kind for kind, question in QUESTIONS.items() if kind in PICTURE_KINDS}
    if images != 1 or _texts(content) not in kinds:
        raise ValueError(f"not a question of the shapes dataset: {images} images, {_texts(content)!r}")
    return kinds[_texts(content)]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cache_root", type=Path, default=None)
    parser.add_argument("--max_examples", type=int, default=DEFAULT_MAX_EXAMPLES)
    arguments = parser.parse_args()
    print(build_vision_corpus(arguments.cache_root, arguments.max_examples))
