"""Rows -> examples: token ids and their labels, the loss on the answers only (`-100` elsewhere) unless
--train_on_prompts. The assistant spans come from the chat template itself: where it marks them with
`{% generation %}`, transformers' assistant mask; otherwise the conversation is rendered message by message and each
answer is the text between the prompt that asks for it (`add_generation_prompt`) and the end of its turn. Large
datasets are encoded by a pool of spawned processes.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from model_utils.data.sft.formats import (GENERATION_BLOCK, IGNORE_INDEX, check_row, resolve_chat_template, row_problem,
                                          sharegpt_messages)


# --------------------------------------------------------------------------------------------------------------------
# Rows -> examples (token ids and their labels, unshifted)
# --------------------------------------------------------------------------------------------------------------------
@dataclass
class Example:
    """One training example: its token ids and, aligned with them, the label of each (the id, or IGNORE_INDEX)."""

    ids: list[int]
    labels: list[int]


class ExampleEncoder:
    """Turns checked rows of one format into Examples with `tokenizer` (a fast tokenizer: offsets locate answers)."""

    def __init__(self, tokenizer, fmt: str, train_on_prompts: bool = False, source: str = "dataset",
                 chat_template: str | None = None):
        self.tokenizer = tokenizer
        self.fmt = fmt
        self.train_on_prompts = train_on_prompts
        self.source = source
        if chat_template is None:
            self.template, self.default_template = resolve_chat_template(tokenizer)
        else:
            self.template, self.default_template = chat_template, False
        self.marks_generation = bool(GENERATION_BLOCK.search(self.template))
        self.eos = tokenizer.eos_token_id
        # What the tokenizer puts before a text (a BOS, for Llama-like tokenizers); chats get it from their template.
        bos = tokenizer.bos_token_id
        self.text_prefix = [i for i in tokenizer("", add_special_tokens=True)["input_ids"] if i == bos][:1]

    def describe(self) -> str:
        if self.fmt not in ("chat", "sharegpt", "alpaca", "prompt_completion"):
            return self.fmt
        template = "default ChatML-like template (the tokenizer has none)" if self.default_template else \
            "the tokenizer's chat template"
        spans = "{% generation %} mask" if self.marks_generation else "rendered turn by turn"
        return f"{self.fmt}, {template}, answers by {spans}"

    def encode(self, row: dict, number: int) -> Example:
        if self.fmt == "chat":
            return self.encode_chat(row["messages"], number)
        if self.fmt == "sharegpt":
            return self.encode_chat(sharegpt_messages(row["conversations"]), number)
        if self.fmt == "alpaca":
            user = row["instruction"] + (f"\n\n{row['input']}" if row.get("input") else "")
            return self.encode_chat([{"role": "user", "content": user},
                                     {"role": "assistant", "content": row["output"]}], number)
        if self.fmt == "prompt_completion":
            if isinstance(row["prompt"], list):
                return self.encode_chat(row["prompt"] + row["completion"], number, first_answer=len(row["prompt"]))
            return self.encode_text(row["prompt"], row["completion"])
        if self.fmt == "tokens":
            ids = list(row["input_ids"])
            labels = row.get("labels")
            return Example(ids, list(ids) if labels is None or self.train_on_prompts else list(labels))
        return self.encode_text("", row["text"])

    def encode_text(self, prompt: str, answer: str) -> Example:
        """Prefix + prompt + answer + EOS, tokenized piece by piece so the boundary is exact; loss on answer + EOS."""
        tok = self.tokenizer
        prompt_ids = self.text_prefix + (tok(prompt, add_special_tokens=False)["input_ids"] if prompt else [])
        answer_ids = tok(answer, add_special_tokens=False)["input_ids"] + [self.eos]
        ids = prompt_ids + answer_ids
        if self.train_on_prompts:
            return Example(ids, list(ids))
        return Example(ids, [IGNORE_INDEX] * len(prompt_ids) + answer_ids)

    def _render(self, messages: list[dict], number: int, generation_prompt: bool = False) -> str:
        from jinja2 import TemplateError

        try:
            return self.tokenizer.apply_chat_template(messages, chat_template=self.template, tokenize=False,
                                                      add_generation_prompt=generation_prompt)
        except TemplateError as e:
            raise row_problem(self.source, number, f"the chat template refuses this conversation ({e})",
                               "fix the conversation (roles, order) or the tokenizer's chat template") from e

    def encode_chat(self, messages: list[dict], number: int, first_answer: int = 0) -> Example:
        """The rendered conversation; loss on the assistant messages from index `first_answer` on."""
        text = self._render(messages, number)
        encoded = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = encoded["input_ids"]
        if self.train_on_prompts:
            return Example(ids, list(ids))
        if self.marks_generation and first_answer == 0:
            mask = self._generation_mask(messages, ids, number)
        else:
            spans = self.answer_spans(messages, text, number, first_answer)
            mask = [any(start < end_span and end > start_span for start_span, end_span in spans) and end > start
                    for start, end in encoded["offset_mapping"]]
        return Example(ids, [i if m else IGNORE_INDEX for i, m in zip(ids, mask)])

    def _generation_mask(self, messages: list[dict], ids: list[int], number: int) -> list[bool]:
        rendered = self.tokenizer.apply_chat_template(messages, chat_template=self.template, tokenize=True,
                                                      return_dict=True, return_assistant_tokens_mask=True)
        if list(rendered["input_ids"]) != list(ids):
            raise row_problem(self.source, number, "the chat template tokenizes differently with its assistant mask",
                               "report the tokenizer; pass --train_on_prompts to train on every token meanwhile")
        return [bool(m) for m in rendered["assistant_masks"]]

    def answer_spans(self, messages: list[dict], text: str, number: int, first_answer: int = 0) -> list[tuple[int, int]]:
        """The character spans of `text` (the whole conversation rendered) that hold the assistant's answers: from the
        end of the prompt that asks for each (the messages before it, with the generation prompt) to the end of its
        turn (as the messages up to it render it; where the template renders a turn differently once later turns
        follow, the answer's content and what closes the turn, found after the prompt), trailing whitespace excluded."""
        spans = []
        for index, message in enumerate(messages):
            if message["role"] != "assistant" or index < first_answer:
                continue
            prompt = self._render(messages[:index], number, generation_prompt=True) if index else ""
            turn = self._render(messages[:index + 1], number)
            if not text.startswith(prompt) or not turn.startswith(prompt):
                raise row_problem(self.source, number, f"the chat template renders the conversation before message "
                                   f"{index + 1} differently once it continues, so its answer cannot be located",
                                   "use a chat template that marks answers with {% generation %}, or pass "
                                   "--train_on_prompts")
            # The whitespace that separates turns is the layout's, not the answer's (as {% generation %} marks it).
            start, rendered_turn = len(prompt), turn[len(prompt):].rstrip()
            if text.startswith(rendered_turn, start):
                spans.append((start, start + len(rendered_turn)))
                continue
            content = message["content"]
            closing = rendered_turn[rendered_turn.rfind(content) + len(content):] if content in rendered_turn else None
            at = text.find(content, start)
            if closing is None or at < 0 or not text.startswith(closing, at + len(content)):
                raise row_problem(self.source, number, f"the answer of message {index + 1} is not where the chat "
                                   "template renders it", "use a chat template that marks answers with "
                                   "{% generation %}, or pass --train_on_prompts")
            spans.append((start, at + len(content) + len(closing)))
        return spans


def check_rows(rows: Iterable[dict], fmt: str, source: str) -> int:
    """Check every row (DataError at the first bad one, naming it) without tokenizing; returns the count."""
    count = 0
    for count, row in enumerate(rows, start=1):
        check_row(row, fmt, count, source)
    return count


def encode_rows(rows: Iterable[dict], encoder: ExampleEncoder, checked: bool = False) -> Iterator[Example]:
    """Encode each row, checking it first unless `checked` (check_rows has)."""
    for number, row in enumerate(rows, start=1):
        if not checked:
            check_row(row, encoder.fmt, number, encoder.source)
        yield encoder.encode(row, number)


# Below this many rows one process encodes faster than worker processes start (each spawned with its tokenizer); a
# worker's task holds at least CHUNK_MIN_ROWS rows.
PARALLEL_MIN_ROWS = 20_000


CHUNK_MIN_ROWS = 500


_WORKER: dict = {}


def encode_all(rows, encoder: ExampleEncoder, workers: int = 1) -> Iterator[Example]:
    """Every checked row's Example, in row order: in this process, or, with `workers` > 1 and at least
    PARALLEL_MIN_ROWS rows, by that many spawned processes (the tokenizer's threads do not survive a fork) encoding
    chunks of rows, at most two chunks per worker in flight. The same Examples either way."""
    count = len(rows)
    if workers <= 1 or count < PARALLEL_MIN_ROWS:
        yield from encode_rows(rows, encoder, checked=True)
        return
    import multiprocessing
    import pickle
    from collections import deque
    from concurrent.futures import ProcessPoolExecutor

    size = max(CHUNK_MIN_ROWS, -(-count // (workers * 16)))
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(workers, mp_context=context, initializer=_start_encoder,
                             initargs=(pickle.dumps(encoder),)) as pool:
        pending: deque = deque()
        for start in range(0, count, size):
            pending.append(pool.submit(_encode_chunk, start, _row_slice(rows, start, start + size)))
            if len(pending) >= 2 * workers:
                yield from pending.popleft().result()
        while pending:
            yield from pending.popleft().result()


def _row_slice(rows, start: int, end: int) -> list[dict]:
    if hasattr(rows, "select"):  # a datasets.Dataset
        return rows.select(range(start, min(end, len(rows)))).to_list()
    return list(rows[start:end])


def _start_encoder(encoder: bytes) -> None:
    import pickle

    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per worker
    _WORKER["encoder"] = pickle.loads(encoder)


def _encode_chunk(start: int, rows: list[dict]) -> list[Example]:
    encoder = _WORKER["encoder"]
    return [encoder.encode(row, start + offset) for offset, row in enumerate(rows, start=1)]
