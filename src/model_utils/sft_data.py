"""Supervised fine-tuning data: rows of instructions or chats -> examples whose loss is on the answers -> packed blocks.

Formats (one per dataset; `--data_format auto` takes it from the columns, in this order of precedence):
  chat               `messages`: a list of {"role", "content"}; loss on the assistant messages.
  prompt_completion  `prompt` and `completion`: two strings (plain text, EOS appended), or two lists of messages
                     (rendered as one chat; loss on the completion's assistant messages).
  alpaca             `instruction`, `output`, optional `input`: rendered as a user turn (instruction, a blank line,
                     input) and an assistant turn (output) through the chat template.
  tokens             `input_ids` (pre-tokenized, taken as they are), optional `labels` (-100: no loss).
  text               `text`: every token carries loss (continued pretraining on examples that stay apart).

Chats are rendered with the tokenizer's own chat template; a tokenizer without one (the shipped default) gets
`DEFAULT_CHAT_TEMPLATE`, and the data description says so. Only the assistant's tokens carry loss (`-100` elsewhere)
unless `train_on_prompts`. The assistant spans come from the template itself: where it marks them with
`{% generation %}`, transformers' assistant mask; otherwise the conversation is rendered message by message and each
answer is the text between the prompt that asks for it (`add_generation_prompt`) and the end of its turn.

Packing: an example of n tokens fills n - 1 positions of a block (inputs: its first n - 1 tokens, targets: its last
n - 1, already shifted), so a block of seq_len positions holds examples of up to seq_len + 1 tokens. Examples are
placed whole, best fit by decreasing length (deterministic), and the rest of a block is padding (target -100). An
example never attends to another: positions restart at 0 for every example (and for the padding), which is what
`concat_dataset.document_positions` gives EOS-separated documents, so the same transformers masking and
FlashAttention-4 varlen path (`document_boundaries`) applies. An example longer than seq_len + 1 tokens keeps its
first seq_len + 1 tokens (counted as truncated); one left with no token carrying loss is dropped (counted).
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from .config import Problem
from .concat_dataset import (HELD_OUT_SEED, DataError, PackedData, held_out_count, token_dtype,
                             tokenizer_identity, tokenizing_processes)

IGNORE_INDEX = -100  # the label transformers' and Liger's cross-entropy skip
FORMATS = ("text", "chat", "prompt_completion", "alpaca", "tokens")
DATA_FORMAT_CHOICES = ("auto", *FORMATS)
# The columns that make a row one format, in the order `auto` tries them (a row with `messages` and `text` is a chat).
REQUIRED_COLUMNS = {"chat": ("messages",), "prompt_completion": ("prompt", "completion"),
                    "alpaca": ("instruction", "output"), "tokens": ("input_ids",), "text": ("text",)}
OPTIONAL_COLUMNS = {"alpaca": ("input",), "tokens": ("labels",)}

# ChatML's layout (<|im_start|>role\ncontent<|im_end|>\n) with the tokenizer's own EOS ending each turn, so that
# generate() stops after the answer; the answer and its EOS are inside {% generation %} (the assistant mask).
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] + eos_token }}{% endgeneration %}"
    "{% else %}{{ message['content'] + eos_token }}{% endif %}"
    "{{ '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
GENERATION_BLOCK = re.compile(r"{%-?\s*generation\s*-?%}")


# --------------------------------------------------------------------------------------------------------------------
# Formats
# --------------------------------------------------------------------------------------------------------------------
def _present(row: dict, column: str) -> bool:
    value = row.get(column)
    return value is not None and not (isinstance(value, list) and len(value) == 0)  # empty text is text


def row_format(row: dict) -> str | None:
    """The format a row's filled columns make (None: none of them), in `REQUIRED_COLUMNS`' order of precedence."""
    for name, columns in REQUIRED_COLUMNS.items():
        if all(_present(row, c) for c in columns):
            return name
    return None


def _known_columns(columns: Iterable[str]) -> list[str]:
    known = {c for cs in (*REQUIRED_COLUMNS.values(), *OPTIONAL_COLUMNS.values()) for c in cs}
    return [c for c in columns if c in known]


def _format_list() -> str:
    return "; ".join(f"{name}: {' + '.join(columns)}" for name, columns in REQUIRED_COLUMNS.items())


def detect_format(columns: list[str], requested: str, source: str) -> str:
    """The dataset's format from its column names: `requested` when it is one of FORMATS and its columns are there,
    else (auto) the first format whose columns all are. Raises DataError naming the file and the columns found."""
    if requested not in DATA_FORMAT_CHOICES:
        raise DataError(Problem("--data_format", requested, "is not a data format",
                                f"use one of {', '.join(DATA_FORMAT_CHOICES)}"))
    if requested != "auto":
        missing = [c for c in REQUIRED_COLUMNS[requested] if c not in columns]
        if missing:
            raise DataError(Problem("--dataset", source, f"has no column {', '.join(missing)} for --data_format "
                                    f"{requested} (columns: {', '.join(columns)})",
                                    f"rename the columns, or pick the format they hold ({_format_list()})"))
        return requested
    for name, required in REQUIRED_COLUMNS.items():
        if all(c in columns for c in required):
            return name
    raise DataError(Problem("--dataset", source, f"matches no fine-tuning format (columns: {', '.join(columns)})",
                            f"give each row the columns of one format ({_format_list()}), or pass --data_format"))


def _row_problem(source: str, number: int, message: str, fix: str) -> DataError:
    return DataError(Problem("--dataset", f"{source}, row {number}", message, fix))


def _is_messages(value) -> bool:
    return (isinstance(value, list) and len(value) > 0 and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value))


def check_row(row: dict, fmt: str, number: int, source: str) -> None:
    """Raise DataError when row `number` (1-based) of `source` does not hold format `fmt`: another format (a mixed
    dataset), missing columns, or values of the wrong type."""
    found = [c for c in _known_columns(row) if _present(row, c)]
    own = row_format(row)
    if own != fmt and not all(_present(row, c) for c in REQUIRED_COLUMNS[fmt]):
        what = f"is {own} ({', '.join(REQUIRED_COLUMNS[own])})" if own else "matches no format"
        raise _row_problem(source, number, f"{what}, but the dataset is {fmt} ({' + '.join(REQUIRED_COLUMNS[fmt])}); "
                           f"columns with values: {', '.join(found) or 'none'}",
                           f"keep one format per dataset: give every row {' + '.join(REQUIRED_COLUMNS[fmt])}, or "
                           "split the data")
    if fmt == "chat":
        messages = row["messages"]
        if not _is_messages(messages):
            raise _row_problem(source, number, "`messages` is not a list of {role, content} with string values",
                               'write messages as [{"role": "user", "content": "..."}, ...]')
        if not any(m["role"] == "assistant" for m in messages):
            raise _row_problem(source, number, "has no assistant message, so no token would carry loss",
                               "add the assistant's answer, or remove the row")
    elif fmt == "prompt_completion":
        prompt, completion = row["prompt"], row["completion"]
        plain = isinstance(prompt, str) and isinstance(completion, str)
        chat = _is_messages(prompt) and _is_messages(completion)
        if not (plain or chat):
            raise _row_problem(source, number, "`prompt` and `completion` are not both strings nor both lists of "
                               f"{{role, content}} ({type(prompt).__name__}, {type(completion).__name__})",
                               "give both as text, or both as messages")
        if chat and not any(m["role"] == "assistant" for m in completion):
            raise _row_problem(source, number, "the completion has no assistant message",
                               "give the completion as assistant messages")
    elif fmt == "alpaca":
        bad = [c for c in ("instruction", "input", "output") if row.get(c) is not None and not isinstance(row[c], str)]
        if bad:
            raise _row_problem(source, number, f"{', '.join(bad)} not text", "write instruction, input and output "
                               "as strings")
    elif fmt == "tokens":
        ids, labels = row["input_ids"], row.get("labels")
        if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
            raise _row_problem(source, number, "`input_ids` is not a list of integers", "store the token ids as a list")
        if labels is not None and (not isinstance(labels, list) or len(labels) != len(ids)):
            raise _row_problem(source, number, f"`labels` does not match `input_ids` ({len(ids)} ids, "
                               f"{len(labels) if isinstance(labels, list) else type(labels).__name__} labels)",
                               "give one label per input id (-100 for no loss), or leave labels out")
    elif not isinstance(row["text"], str):
        raise _row_problem(source, number, f"`text` is {type(row['text']).__name__}, not text", "store text as strings")


# --------------------------------------------------------------------------------------------------------------------
# Rows -> examples (token ids and their labels, unshifted)
# --------------------------------------------------------------------------------------------------------------------
@dataclass
class Example:
    """One training example: its token ids and, aligned with them, the label of each (the id, or IGNORE_INDEX)."""

    ids: list[int]
    labels: list[int]


def resolve_chat_template(tokenizer) -> tuple[str, bool]:
    """(the template chats are rendered with, whether it is DEFAULT_CHAT_TEMPLATE because the tokenizer has none)."""
    own = getattr(tokenizer, "chat_template", None)
    if isinstance(own, dict):  # several named templates: the default one
        own = own.get("default")
    return (own, False) if isinstance(own, str) and own.strip() else (DEFAULT_CHAT_TEMPLATE, True)


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
        if self.fmt not in ("chat", "alpaca", "prompt_completion"):
            return self.fmt
        template = "default ChatML-like template (the tokenizer has none)" if self.default_template else \
            "the tokenizer's chat template"
        spans = "{% generation %} mask" if self.marks_generation else "rendered turn by turn"
        return f"{self.fmt}, {template}, answers by {spans}"

    def encode(self, row: dict, number: int) -> Example:
        if self.fmt == "chat":
            return self.encode_chat(row["messages"], number)
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
            raise _row_problem(self.source, number, f"the chat template refuses this conversation ({e})",
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
            raise _row_problem(self.source, number, "the chat template tokenizes differently with its assistant mask",
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
                raise _row_problem(self.source, number, f"the chat template renders the conversation before message "
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
                raise _row_problem(self.source, number, f"the answer of message {index + 1} is not where the chat "
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


def attach_chat_template(tokenizer) -> bool:
    """Give a tokenizer without a chat template DEFAULT_CHAT_TEMPLATE, the one its chats were rendered with, so that an
    exported model is prompted as it was trained (call before the tokenizer is written). True where it was attached."""
    template, is_default = resolve_chat_template(tokenizer)
    if is_default:
        tokenizer.chat_template = template
    return is_default


# --------------------------------------------------------------------------------------------------------------------
# Examples -> packed blocks
# --------------------------------------------------------------------------------------------------------------------
@dataclass
class PackingStats:
    """What packing made of the examples: for the run's data line and the cache's meta.json."""

    examples: int = 0  # examples placed in blocks
    tokens: int = 0  # positions the examples fill (an example of n tokens fills n - 1)
    loss_tokens: int = 0  # of those, positions whose target carries loss
    truncated: int = 0  # examples longer than seq_len + 1 tokens, cut to their first seq_len + 1
    dropped: int = 0  # examples left without a target carrying loss (or shorter than 2 tokens), not placed
    blocks: int = 0
    seq_len: int = 0

    @property
    def loss_share(self) -> float:
        return self.loss_tokens / self.tokens if self.tokens else 0.0

    @property
    def padding_share(self) -> float:
        slots = self.blocks * self.seq_len
        return 1 - self.tokens / slots if slots else 0.0

    def describe(self) -> str:
        return (f"{self.examples:,} examples, {self.tokens:,} tokens, {100 * self.loss_share:.1f}% with loss, "
                f"{self.truncated:,} truncated to {self.seq_len + 1} tokens, {self.dropped:,} dropped without loss "
                f"-> {self.blocks:,} blocks of {self.seq_len} ({100 * self.padding_share:.1f}% padding)")


def shifted(example: Example, seq_len: int) -> tuple[np.ndarray, np.ndarray, bool]:
    """(inputs, targets, truncated): an example's first n - 1 tokens and its last n - 1 labels, at most seq_len."""
    truncated = len(example.ids) > seq_len + 1
    ids = np.asarray(example.ids[:seq_len + 1], dtype=np.int64)
    labels = np.asarray(example.labels[:seq_len + 1], dtype=np.int64)
    return ids[:-1], labels[1:], truncated


def best_fit_blocks(lengths: list[int], seq_len: int) -> list[list[int]]:
    """Example indices per block: by decreasing length (ties by index), each into the fullest block it still fits;
    within a block, examples in their original order. Deterministic for the same lengths."""
    free: list[tuple[int, int]] = []  # (room left, block), sorted
    blocks: list[list[int]] = []
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        need = lengths[index]
        at = bisect.bisect_left(free, (need, -1))
        if at == len(free):
            blocks.append([index])
            room, block = seq_len - need, len(blocks) - 1
        else:
            room, block = free.pop(at)
            blocks[block].append(index)
            room -= need
        if room > 0:
            bisect.insort(free, (room, block))
    return [sorted(b) for b in blocks]


@dataclass
class PackedArrays:
    """Blocks of seq_len positions, flat: input ids, shifted targets (IGNORE_INDEX: no loss) and each position's
    index within its example (0 where an example, or the padding, starts)."""

    inputs: np.ndarray
    targets: np.ndarray
    positions: np.ndarray
    stats: PackingStats = field(default_factory=PackingStats)


def pack_examples(examples: Iterable[Example], seq_len: int, pad_id: int, vocab_size: int) -> PackedArrays:
    """Pack examples whole into blocks of seq_len (module docstring: truncation, dropping, padding)."""
    stats = PackingStats(seq_len=seq_len)
    pieces: list[tuple[np.ndarray, np.ndarray]] = []
    for example in examples:
        inputs, targets, truncated = shifted(example, seq_len)
        if len(inputs) == 0 or not (targets != IGNORE_INDEX).any():
            stats.dropped += 1
            continue
        stats.truncated += truncated
        stats.loss_tokens += int((targets != IGNORE_INDEX).sum())
        stats.tokens += len(inputs)
        pieces.append((inputs, targets))
    stats.examples = len(pieces)
    layout = best_fit_blocks([len(p[0]) for p in pieces], seq_len)
    stats.blocks = len(layout)
    inputs = np.full(len(layout) * seq_len, pad_id, dtype=token_dtype(vocab_size))
    targets = np.full(len(layout) * seq_len, IGNORE_INDEX, dtype=np.int32)
    positions = np.zeros(len(layout) * seq_len, dtype=np.uint16 if seq_len <= 1 << 16 else np.int32)
    for block, members in enumerate(layout):
        at = block * seq_len
        for index in members:
            piece_inputs, piece_targets = pieces[index]
            n = len(piece_inputs)
            inputs[at:at + n], targets[at:at + n], positions[at:at + n] = piece_inputs, piece_targets, np.arange(n)
            at += n
        end = (block + 1) * seq_len
        positions[at:end] = np.arange(end - at)  # the padding is a segment of its own
    return PackedArrays(inputs, targets, positions, stats)


class PackedExamples:
    """Packed SFT blocks read like `concat_dataset.PackedTokens`: `num_blocks`, `seq_len`, `tokens` (the flat input
    ids, for the data fingerprint) and `batch(indices)`, here an `ExampleBatch` rather than a token array."""

    def __init__(self, inputs: np.ndarray, targets: np.ndarray, positions: np.ndarray, seq_len: int):
        self.tokens, self.targets, self.positions = inputs, targets, positions
        self.seq_len = seq_len
        self.num_blocks = len(inputs) // seq_len

    def _rows(self, array: np.ndarray, indices) -> np.ndarray:
        return np.stack([array[int(i) * self.seq_len:(int(i) + 1) * self.seq_len] for i in indices]).astype(np.int64)

    def batch(self, indices) -> ExampleBatch:
        return ExampleBatch(self._rows(self.tokens, indices), self._rows(self.targets, indices),
                            self._rows(self.positions, indices))


@dataclass
class ExampleBatch:
    """Rows of blocks (int64, B x seq_len): input ids, shifted targets, positions within each example."""

    input_ids: np.ndarray
    targets: np.ndarray
    position_ids: np.ndarray

    def model_arrays(self, document_boundaries: bool = False) -> dict:
        """The model's keyword arguments as host arrays (the loop moves each to the device): `labels` and
        `shift_labels` are the shifted targets, as `train_deepspeed.model_inputs` gives them; with
        `document_boundaries` (FlashAttention-4) also the examples' offsets in the flattened batch."""
        from .concat_dataset import document_boundaries as boundaries_of

        arrays = {"input_ids": self.input_ids, "labels": self.targets, "shift_labels": self.targets,
                  "position_ids": self.position_ids}
        if document_boundaries:
            cu = boundaries_of(self.position_ids)
            seq_len = self.input_ids.shape[1]
            arrays.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=seq_len, max_length_k=seq_len)
        return arrays

    @property
    def loss_tokens(self) -> int:
        """Targets carrying loss: the count the mean loss of the batch divides by."""
        return int((self.targets != IGNORE_INDEX).sum())


# --------------------------------------------------------------------------------------------------------------------
# The cache: build once (one process), open memory-mapped everywhere
# --------------------------------------------------------------------------------------------------------------------
@dataclass
class SFTSettings:
    """What the packed SFT data depends on besides the rows and the tokenizer (part of the cache key)."""

    seq_len: int
    data_format: str = "auto"  # --data_format
    train_on_prompts: bool = False  # --train_on_prompts
    validation_fraction: float = 0.01  # held-out blocks when the data has no validation split


def sft_cache_dir(root: Path, source_identity: str, tokenizer, settings: SFTSettings) -> Path:
    """The cache directory of this data packed with this tokenizer, template and settings."""
    template, _ = resolve_chat_template(tokenizer)
    parts = [source_identity, tokenizer_identity(tokenizer), hashlib.sha256(template.encode()).hexdigest(),
             settings.data_format, str(settings.train_on_prompts), str(settings.seq_len)]
    return Path(root) / "sft" / hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def _write_array(array: np.ndarray, path: Path) -> None:
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    array.tofile(tmp)
    os.replace(tmp, path)


SPLIT_FILES = ("inputs", "targets", "positions")


def build_sft_files(splits: dict, tokenizer, settings: SFTSettings, out_dir: Path, source: str,
                    log=print, workers: int = 1) -> dict:
    """Check every row of each split, then encode (with `workers` processes: encode_all) and pack each
    (`{"train": rows, "validation": rows or None}`; rows: a datasets.Dataset, or a list of dicts whose first row names
    the columns) and write <split>.{inputs,targets,positions}.bin and meta.json (written last: it marks a complete
    entry). Returns the meta."""
    splits = {split: rows for split, rows in splits.items() if rows is not None}
    formats: dict[str, str] = {}
    for split, rows in splits.items():  # every row of every split checked before any is tokenized
        columns = list(getattr(rows, "column_names", None) or (next(iter(rows), None) or {}).keys())
        requested = next(iter(formats.values()), settings.data_format)  # the validation split: the train's format
        formats[split] = detect_format(columns, requested, f"{source} ({split} split)")
        check_rows(rows, formats[split], f"{source} ({split} split)")
    out_dir.mkdir(parents=True, exist_ok=True)
    meta: dict = {"seq_len": settings.seq_len, "splits": {}}
    for split, rows in splits.items():
        encoder = ExampleEncoder(tokenizer, formats[split], settings.train_on_prompts, f"{source} ({split} split)")
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        packed = pack_examples(encode_all(rows, encoder, workers), settings.seq_len, pad_id, len(tokenizer))
        if packed.stats.blocks == 0:
            raise DataError(Problem("--dataset", source, f"the {split} split holds no example with a token "
                                    "carrying loss", "check the data (answers present) or pass --train_on_prompts"))
        for name in SPLIT_FILES:
            _write_array(getattr(packed, name), out_dir / f"{split}.{name}.bin")
        meta["splits"][split] = {"stats": asdict(packed.stats), "dtypes": {n: getattr(packed, n).dtype.name
                                                                           for n in SPLIT_FILES}}
        meta["format"] = encoder.describe()
        log(f"data: {split}: {packed.stats.describe()}")
    (out_dir / "meta.json").write_text(json.dumps(meta, indent=1))
    return meta


def _open_split(out_dir: Path, split: str, meta: dict) -> PackedExamples:
    dtypes = meta["splits"][split]["dtypes"]
    arrays = [np.memmap(out_dir / f"{split}.{n}.bin", dtype=np.dtype(dtypes[n]), mode="r") for n in SPLIT_FILES]
    return PackedExamples(*arrays, seq_len=meta["seq_len"])


def held_out_blocks(num_blocks: int, fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """(training block ids, validation block ids) when the data has no validation split; fixed by HELD_OUT_SEED."""
    ids = np.random.default_rng(HELD_OUT_SEED).permutation(num_blocks)
    n_val = held_out_count(num_blocks, fraction)
    return np.sort(ids[n_val:]), np.sort(ids[:n_val])


def open_sft(out_dir: Path, validation_fraction: float = SFTSettings.validation_fraction) -> PackedData:
    """The packed SFT data as the loop reads `PackedData`: train/val are PackedExamples, the blocks' ids, and the
    description for the run's data line (format, template, the statistics)."""
    meta = json.loads((out_dir / "meta.json").read_text())
    train = _open_split(out_dir, "train", meta)
    if "validation" in meta["splits"]:
        val = _open_split(out_dir, "validation", meta)
        train_ids, val_ids = np.arange(train.num_blocks), np.arange(val.num_blocks)
    else:
        val = train
        train_ids, val_ids = held_out_blocks(train.num_blocks, validation_fraction)
    stats = PackingStats(**meta["splits"]["train"]["stats"])
    description = (f"fine-tuning data ({meta['format']}): {stats.describe()}; {len(train_ids):,} training blocks "
                   f"(+{len(val_ids):,} validation)")
    return PackedData(train, train_ids, val, val_ids, description)


# --------------------------------------------------------------------------------------------------------------------
# The run's data: which format, the splits, the cache built by one rank
# --------------------------------------------------------------------------------------------------------------------
PRETRAINING = "pretraining"  # resolve_data_format's answer for documents concatenated into blocks (concat_dataset)
PRETRAINING_KINDS = ("prepared", "npy", "mixture")  # sources only the pretraining pipeline reads


def _first_json_record(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        head = f.read(1 << 20)
    if head.lstrip().startswith("["):  # one JSON document (a list of records)
        records = json.loads(Path(path).read_text(encoding="utf-8"))
        return records[0] if records and isinstance(records[0], dict) else {}
    for line in head.splitlines():
        if line.strip():
            record = json.loads(line)
            return record if isinstance(record, dict) else {}
    return {}


def source_columns(source, cfg) -> list[str]:
    """The column names of a data source's training split, read from its first record or its schema (a hub dataset:
    its first row, streamed). Raises DataError where they cannot be read."""
    from .concat_dataset import LOAD_ERRORS, load_problem, stream_documents

    try:
        if source.kind in ("files", "embedded", "embedded-chat"):
            first = source.files[0]
            if source.builder == "json":
                return list(_first_json_record(first))
            if source.builder == "parquet":
                import pyarrow.parquet

                return list(pyarrow.parquet.ParquetFile(first).schema_arrow.names)
            if source.builder == "csv":
                import csv

                with open(first, encoding="utf-8", newline="") as f:
                    return next(csv.reader(f), [])
            if source.builder == "text":
                return ["text"]
        if source.kind == "disk":
            import datasets

            loaded = datasets.load_from_disk(source.location)
            if isinstance(loaded, datasets.DatasetDict):
                loaded = loaded["train" if "train" in loaded else next(iter(loaded))]
            return list(loaded.column_names)
        if source.kind == "hub":
            rows = list(stream_documents(source.location, cfg.dataset_config_name, None, "train", 1))
            return list(rows[0]) if rows else []
        # arrow files: the loader reads them
        from .concat_dataset import load_splits

        return list(load_splits(source, cfg)[0].column_names)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise load_problem(source, e) from e
    except LOAD_ERRORS as e:
        raise load_problem(source, e) from e


def resolve_data_format(cfg, source) -> str:
    """--data_format resolved for this source: a fine-tuning format (FORMATS), or PRETRAINING (documents concatenated
    into blocks, concat_dataset's pipeline). auto: chat, prompt_completion or alpaca from the columns, tokens where a
    labels column comes with input_ids, else PRETRAINING. Raises DataError naming the data and the columns where an
    explicit format's columns are missing or the source is one only pretraining reads."""
    if source is None:
        return PRETRAINING
    if source.kind in PRETRAINING_KINDS:
        if cfg.data_format in FORMATS:
            raise DataError(Problem("--data_format", cfg.data_format, f"{source.location} is {source.kind} data, "
                                    "which holds token streams without examples", "leave --data_format at auto, or "
                                    "point --dataset at rows (JSONL, Parquet, a saved dataset)"))
        return PRETRAINING
    columns = source_columns(source, cfg)
    if cfg.data_format == "auto":
        fmt = next((name for name, required in REQUIRED_COLUMNS.items() if all(c in columns for c in required)), None)
        if fmt in ("chat", "prompt_completion", "alpaca") or (fmt == "tokens" and "labels" in columns):
            return fmt
        return PRETRAINING
    return detect_format(columns, cfg.data_format, source.location)


def load_sft_splits(source, cfg):
    """(train, validation or None) of a fine-tuning source: the embedded chat dataset's two files as its splits,
    anything else as concat_dataset.load_splits reads it."""
    from .concat_dataset import load_splits

    if source.kind != "embedded-chat":
        return load_splits(source, cfg)
    import datasets

    from .concat_dataset import _hf_cache
    from .sft_corpus import split_files

    loaded = datasets.load_dataset("json", data_files=split_files(Path(source.location)), cache_dir=_hf_cache(cfg))
    splits = loaded["train"], loaded["validation"]
    if cfg.max_documents:  # the first N examples of each split
        splits = tuple(split.select(range(min(cfg.max_documents, len(split)))) for split in splits)
    return splits


def open_sft_source(cfg, source, tokenizer, seq_len: int, data_format: str, dist, log=print) -> PackedData:
    """The packed fine-tuning data on every rank: global rank 0 encodes and packs them into the cache
    (concat_dataset.ensure_token_cache's protocol: the other ranks wait on its files), then every rank memory-maps
    them (open_sft)."""
    from .concat_dataset import ensure_token_cache

    settings = SFTSettings(seq_len, data_format, cfg.train_on_prompts, cfg.validation_fraction)
    out_dir = sft_cache_dir(_cache_root(cfg), source_key(source, cfg), tokenizer, settings)

    def build(cfg, tokenizer, out_dir, log, source, progress=None):
        train, validation = load_sft_splits(source, cfg)
        if progress is not None:
            progress.set_total(len(train) + (len(validation) if validation is not None else 0))
        meta = build_sft_files({"train": train, "validation": validation}, tokenizer, settings, out_dir,
                               source.location, log, tokenizing_processes(cfg.num_proc))
        if progress is not None:
            examples = sum(split["stats"]["examples"] for split in meta["splits"].values())
            tokens = sum(split["stats"]["tokens"] for split in meta["splits"].values())
            progress.update(examples, tokens, examples)

    ensure_token_cache(cfg, source, tokenizer, out_dir, dist, log, build=build)
    return open_sft(out_dir, cfg.validation_fraction)


def source_key(source, cfg) -> str:
    """What the packed examples are made of: the source and, with --max_documents, how many of its rows."""
    return source.identity() + (f"|max_documents={cfg.max_documents}" if cfg.max_documents else "")


def _cache_root(cfg) -> Path:
    from .corpus import default_cache_root

    return Path(cfg.data_cache_dir) if cfg.data_cache_dir else default_cache_root()


def ensure_sft_cache(cfg, tokenizer, settings: SFTSettings, source=None, log=print) -> Path:
    """The cache directory of the fine-tuning data, built here where it is missing (one process, no other ranks:
    tools and tests; a run goes through open_sft_source). `source`: the resolved --dataset."""
    from .concat_dataset import resolve_source

    source = source or resolve_source(cfg)
    out_dir = sft_cache_dir(_cache_root(cfg), source_key(source, cfg), tokenizer, settings)
    if not (out_dir / "meta.json").exists():
        train, validation = load_sft_splits(source, cfg)
        build_sft_files({"train": train, "validation": validation}, tokenizer, settings, out_dir, source.location,
                        log, tokenizing_processes(cfg.num_proc))
    return out_dir
