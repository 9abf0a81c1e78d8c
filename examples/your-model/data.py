"""The data of a model of your own: the project's embedded pictures of shapes, each with a question and its answer.

    python src/train_deepspeed.py --model examples/your-model/model.py:build \\
        --dataset examples/your-model/data.py:build --config examples/your-model/stages.yaml

The trainer imports this file and calls `build(settings)` for the run's data, and for each stage with `data_args:` of
its own (merged over the run's). `settings.args` holds those data_args, `settings.stage` the stage's name (or None),
and `tokenizer`, `seq_len` and `seed` are as for the model. `build` returns {"train": dataset, "validation": dataset,
"collate": function}: the datasets map-style (len and [index]), the collate turning a list of items into the batch
whose keys are the keyword arguments of the model's forward. The trainer shuffles, shards the items over the GPUs and
batches them. Nothing is downloaded: the pictures are drawn by `model_utils.data.vision.shapes`.
"""

import numpy as np
import torch
from torch.utils.data import Dataset, default_collate

from model_utils.data.vision.shapes import select_examples

IMAGE_SIZE = 32  # the model's encoder takes 3 x 32 x 32
CAPTION_PROMPT = "Describe the picture."
TASKS = ("captions", "questions")


def caption(picture):
    """What a caption says of a picture: all it shows, e.g. "3 red circles." (the shapes' count, colour, kind)."""
    count = len(picture.boxes)
    return f"{count} {picture.colour} {picture.kind}{'s' if count > 1 else ''}."


def text_item(tokenizer, prompt, answer, seq_len):
    """input_ids: prompt, answer, EOS, cut or padded to seq_len. labels[t]: the token after position t where that
    token is the answer's or the EOS (the model learns to answer), -100 elsewhere (the prompt and the padding)."""
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    answer_ids = tokenizer(" " + answer, add_special_tokens=False)["input_ids"]
    ids = prompt_ids + answer_ids + [tokenizer.eos_token_id]
    labels = [ids[t + 1] if t + 1 >= len(prompt_ids) else -100 for t in range(len(ids) - 1)] + [-100]
    pad = max(0, seq_len - len(ids))
    input_ids = ids[:seq_len] + [tokenizer.pad_token_id] * pad  # cut: the last position keeps its target
    labels = labels[:seq_len] + [-100] * pad
    return torch.tensor(input_ids), torch.tensor(labels)


class Shapes(Dataset):
    """One picture per item: its texts tokenized here, once (small); its pixels drawn when the item is read."""

    def __init__(self, examples, tokenizer, seq_len, task):
        self.pictures = [chosen.pictures[0] for chosen in examples]
        self.texts = [text_item(tokenizer, CAPTION_PROMPT, caption(chosen.pictures[0]), seq_len) if task == "captions"
                      else text_item(tokenizer, chosen.question, chosen.answer, seq_len) for chosen in examples]

    def __len__(self):
        return len(self.pictures)

    def __getitem__(self, index):
        image = self.pictures[index].draw().resize((IMAGE_SIZE, IMAGE_SIZE))  # PIL RGB
        pixels = torch.from_numpy(np.array(image, dtype=np.float32) / 255.0).permute(2, 0, 1).contiguous()
        input_ids, labels = self.texts[index]
        return {"pixels": pixels, "input_ids": input_ids, "labels": labels}


def collate(items):
    """A list of items -> one batch, each key stacked: (batch, 3, 32, 32), (batch, seq_len), (batch, seq_len).
    Items of one length stack as they are; items of different lengths would pad here, in your own collate."""
    return default_collate(items)


def build(settings):
    """The entry point: `--dataset examples/your-model/data.py:build`."""
    args = dict(settings.args or {})
    task = args.get("task", "questions")  # captions (stage 1) or questions
    if task not in TASKS:
        raise ValueError(f"data_args task: {task!r}, expected one of {', '.join(TASKS)}")
    splits = select_examples(int(args.get("max_examples", 2000)))  # the same examples on every run and rank
    # Only the questions about one picture (colour, kind, count): the encoder takes one image.
    splits = {split: [chosen for chosen in examples if len(chosen.pictures) == 1] for split, examples in splits.items()}
    return {"train": Shapes(splits["train"], settings.tokenizer, settings.seq_len, task),
            "validation": Shapes(splits["validation"], settings.tokenizer, settings.seq_len, task),
            "collate": collate}
