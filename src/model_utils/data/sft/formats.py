"""Fine-tuning rows: their formats (chat, sharegpt, prompt_completion, alpaca, tokens, text), detected from the
columns or named by --data_format, each row checked with a Problem naming the row and the fix, and the chat template
chats are rendered with (the tokenizer's own, else DEFAULT_CHAT_TEMPLATE).

Formats (one per dataset; `--data_format auto` takes it from the columns, in this order of precedence):
  chat               `messages`: a list of {"role", "content"}; loss on the assistant messages.
  sharegpt           `conversations`: a list of {"from", "value"} (ShareGPT's rows, as axolotl and many hub
                     datasets hold chats), from human, gpt or system (user, assistant, tool also read); read as a
                     chat, loss on the gpt turns.
  prompt_completion  `prompt` and `completion`: two strings (plain text, EOS appended), or two lists of messages
                     (rendered as one chat; loss on the completion's assistant messages).
  alpaca             `instruction`, `output`, optional `input`: rendered as a user turn (instruction, a blank line,
                     input) and an assistant turn (output) through the chat template.
  tokens             `input_ids` (pre-tokenized, taken as they are), optional `labels` (-100: no loss).
  text               `text`: every token carries loss (continued pretraining on examples that stay apart).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path

from model_utils.core.problems import Problem
from model_utils.data.errors import LOAD_ERRORS, DataError
from model_utils.data.loading import load_problem, load_splits, stream_documents

IGNORE_INDEX = -100  # the label transformers' and Liger's cross-entropy skip


FORMATS = ("text", "chat", "sharegpt", "prompt_completion", "alpaca", "tokens")


DATA_FORMAT_CHOICES = ("auto", *FORMATS)


# The columns that make a row one format, in the order `auto` tries them (a row with `messages` and `text` is a chat).
REQUIRED_COLUMNS = {"chat": ("messages",), "sharegpt": ("conversations",),
                    "prompt_completion": ("prompt", "completion"), "alpaca": ("instruction", "output"),
                    "tokens": ("input_ids",), "text": ("text",)}


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


def row_problem(source: str, number: int, message: str, fix: str) -> DataError:
    return DataError(Problem("--dataset", f"{source}, row {number}", message, fix))


def _is_messages(value) -> bool:
    return (isinstance(value, list) and len(value) > 0 and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value))


# ShareGPT's speakers and the chat roles they are rendered as (human/gpt/system are ShareGPT's own; the others are
# what datasets converted from chats write in `from`).
SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "system": "system", "user": "user", "assistant": "assistant",
                  "tool": "tool"}


def sharegpt_messages(turns: list[dict]) -> list[dict]:
    """A checked ShareGPT conversation as chat messages ({from, value} -> {role, content})."""
    return [{"role": SHAREGPT_ROLES[turn["from"]], "content": turn["value"]} for turn in turns]


def _sharegpt_problem(turns) -> tuple[str, str] | None:
    """(what is wrong, the fix) for a `conversations` value that is not a ShareGPT conversation, else None."""
    shape = '[{"from": "human", "value": "..."}, {"from": "gpt", "value": "..."}]'
    if not isinstance(turns, list) or not turns or not all(
            isinstance(t, dict) and isinstance(t.get("from"), str) and isinstance(t.get("value"), str) for t in turns):
        return "`conversations` is not a list of {from, value} with string values", f"write it as {shape}"
    unknown = sorted({t["from"] for t in turns} - SHAREGPT_ROLES.keys())
    if unknown:
        return (f"`conversations` has speakers ShareGPT does not name: {', '.join(unknown)}",
                f"use {', '.join(SHAREGPT_ROLES)} in `from` (gpt turns carry the loss)")
    if not any(SHAREGPT_ROLES[t["from"]] == "assistant" for t in turns):
        return "has no gpt turn, so no token would carry loss", "add the answer as a gpt turn, or remove the row"
    return None


def check_row(row: dict, fmt: str, number: int, source: str) -> None:
    """Raise DataError when row `number` (1-based) of `source` does not hold format `fmt`: another format (a mixed
    dataset), missing columns, or values of the wrong type."""
    found = [c for c in _known_columns(row) if _present(row, c)]
    own = row_format(row)
    if own != fmt and not all(_present(row, c) for c in REQUIRED_COLUMNS[fmt]):
        what = f"is {own} ({', '.join(REQUIRED_COLUMNS[own])})" if own else "matches no format"
        raise row_problem(source, number, f"{what}, but the dataset is {fmt} ({' + '.join(REQUIRED_COLUMNS[fmt])}); "
                           f"columns with values: {', '.join(found) or 'none'}",
                           f"keep one format per dataset: give every row {' + '.join(REQUIRED_COLUMNS[fmt])}, or "
                           "split the data")
    if fmt == "chat":
        messages = row["messages"]
        if not _is_messages(messages):
            raise row_problem(source, number, "`messages` is not a list of {role, content} with string values",
                               'write messages as [{"role": "user", "content": "..."}, ...]')
        if not any(m["role"] == "assistant" for m in messages):
            raise row_problem(source, number, "has no assistant message, so no token would carry loss",
                               "add the assistant's answer, or remove the row")
    elif fmt == "sharegpt":
        problem = _sharegpt_problem(row["conversations"])
        if problem:
            raise row_problem(source, number, *problem)
    elif fmt == "prompt_completion":
        prompt, completion = row["prompt"], row["completion"]
        plain = isinstance(prompt, str) and isinstance(completion, str)
        chat = _is_messages(prompt) and _is_messages(completion)
        if not (plain or chat):
            raise row_problem(source, number, "`prompt` and `completion` are not both strings nor both lists of "
                               f"{{role, content}} ({type(prompt).__name__}, {type(completion).__name__})",
                               "give both as text, or both as messages")
        if chat and not any(m["role"] == "assistant" for m in completion):
            raise row_problem(source, number, "the completion has no assistant message",
                               "give the completion as assistant messages")
    elif fmt == "alpaca":
        bad = [c for c in ("instruction", "input", "output") if row.get(c) is not None and not isinstance(row[c], str)]
        if bad:
            raise row_problem(source, number, f"{', '.join(bad)} not text", "write instruction, input and output "
                               "as strings")
    elif fmt == "tokens":
        ids, labels = row["input_ids"], row.get("labels")
        if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
            raise row_problem(source, number, "`input_ids` is not a list of integers", "store the token ids as a list")
        if labels is not None and (not isinstance(labels, list) or len(labels) != len(ids)):
            raise row_problem(source, number, f"`labels` does not match `input_ids` ({len(ids)} ids, "
                               f"{len(labels) if isinstance(labels, list) else type(labels).__name__} labels)",
                               "give one label per input id (-100 for no loss), or leave labels out")
    elif not isinstance(row["text"], str):
        raise row_problem(source, number, f"`text` is {type(row['text']).__name__}, not text", "store text as strings")


def resolve_chat_template(tokenizer) -> tuple[str, bool]:
    """(the template chats are rendered with, whether it is DEFAULT_CHAT_TEMPLATE because the tokenizer has none)."""
    own = getattr(tokenizer, "chat_template", None)
    if isinstance(own, dict):  # several named templates: the default one
        own = own.get("default")
    return (own, False) if isinstance(own, str) and own.strip() else (DEFAULT_CHAT_TEMPLATE, True)


def attach_chat_template(tokenizer) -> bool:
    """Give a tokenizer without a chat template DEFAULT_CHAT_TEMPLATE, the one its chats were rendered with, so that an
    exported model is prompted as it was trained (call before the tokenizer is written). True where it was attached."""
    template, is_default = resolve_chat_template(tokenizer)
    if is_default:
        tokenizer.chat_template = template
    return is_default


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
    try:
        # A stream of local files reads its columns as those files do; a stream of a hub dataset as the hub does.
        if (source.kind in ("files", "embedded", "embedded-chat", "embedded-preference", "embedded-vision")
                or (source.kind == "stream" and source.files)):
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
        if source.kind in ("hub", "stream"):
            rows = list(stream_documents(source.location, cfg.dataset_config_name, None, "train", 1))
            return list(rows[0]) if rows else []
        # arrow files: the loader reads them

        return list(load_splits(source, cfg)[0].column_names)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise load_problem(source, e) from e
    except LOAD_ERRORS as e:
        raise load_problem(source, e) from e


def resolve_data_format(cfg, source, columns: list[str] | None = None) -> str:
    """--data_format resolved for this source: a fine-tuning format (FORMATS), or PRETRAINING (documents concatenated
    into blocks, concat_dataset's pipeline). auto: chat, prompt_completion or alpaca from the columns, tokens where a
    labels column comes with input_ids, else PRETRAINING. Raises DataError naming the data and the columns where an
    explicit format's columns are missing or the source is one only pretraining reads. `columns`: the source's, where
    the caller read them already."""
    if source is None:
        return PRETRAINING
    if source.kind in PRETRAINING_KINDS:
        if cfg.data_format in FORMATS:
            raise DataError(Problem("--data_format", cfg.data_format, f"{source.location} is {source.kind} data, "
                                    "which holds token streams without examples", "leave --data_format at auto, or "
                                    "point --dataset at rows (JSONL, Parquet, a saved dataset)"))
        return PRETRAINING
    columns = columns if columns is not None else source_columns(source, cfg)
    if cfg.data_format == "auto":
        fmt = next((name for name, required in REQUIRED_COLUMNS.items() if all(c in columns for c in required)), None)
        if fmt in ("chat", "sharegpt", "prompt_completion", "alpaca") or (fmt == "tokens" and "labels" in columns):
            return fmt
        if fmt is None and cfg.text_column not in columns and "input_ids" not in columns:
            raise DataError(Problem("--text_column", cfg.text_column, f"{source.location} has no such column for "
                                    "pretraining text, and its rows hold no fine-tuning format's columns (columns: "
                                    f"{', '.join(columns) or 'none'})", "pass --text_column with the column that "
                                    "holds the text, or give the rows the columns of one fine-tuning format "
                                    f"({_format_list()}; docs/FINE-TUNING.md)"))
        return PRETRAINING
    return detect_format(columns, cfg.data_format, source.location)
