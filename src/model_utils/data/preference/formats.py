"""Preference rows as TRL 1.16 reads them, each checked with a Problem naming the row and the fix.

  explicit prompt   `prompt`, `chosen`, `rejected`: three strings (chosen and rejected continue the prompt), or
                    conversational: the prompt a list of {role, content} messages, chosen and rejected lists holding
                    the assistant's turn.
  implicit prompt   `chosen` and `rejected` only: two whole conversations that share their first turns (as
                    UltraFeedback-binarized holds them), or two strings that share their start; the longest common
                    prefix is the prompt (trl.extract_prompt). Two conversations that differ before the assistant's
                    turn (another user turn) answer two prompts, and are refused.

`--data_format auto` takes rows with `chosen` and `rejected` for pairs; `--preference` must be on to tune on them.
"""

from __future__ import annotations

from model_utils.core.problems import Problem
from model_utils.data.errors import DataError
from model_utils.data.sft.formats import PRETRAINING, PRETRAINING_KINDS, row_problem, source_columns
from model_utils.data.sft.formats import resolve_data_format as resolve_example_format

PREFERENCE = "preference"
PAIR_COLUMNS = ("chosen", "rejected")
ROW_SHAPE = ('{"prompt": "...", "chosen": "...", "rejected": "..."}, or conversational: {"prompt": [{"role": '
             '"user", "content": "..."}], "chosen": [{"role": "assistant", "content": "..."}], "rejected": [...]}')


def is_pair_columns(columns) -> bool:
    return all(c in columns for c in PAIR_COLUMNS)


def resolve_run_format(cfg_data, source, preference_on: bool) -> str:
    """The run's data format: PREFERENCE for pairs (--data_format preference, or auto with chosen and rejected
    columns), else what data.sft.formats.resolve_data_format makes of the rows. Raises DataError where the rows and
    --preference disagree, naming the columns found and the fix."""
    if source is None:
        return PRETRAINING
    columns = source_columns(source, cfg_data) if source.kind not in PRETRAINING_KINDS else []
    if preference_on:
        if is_pair_columns(columns):
            return PREFERENCE
        raise DataError(Problem("--dataset", source.location, "--preference tunes on pairs of a better and a worse "
                                f"answer, and these rows hold no chosen and rejected columns (columns: "
                                f"{', '.join(columns) or 'none'})", f"give each row {ROW_SHAPE} (docs/PREFERENCE.md), "
                                "or drop --preference to fine-tune on them as they are"))
    if is_pair_columns(columns) and cfg_data.data_format == "auto":
        raise DataError(Problem("--preference", "off", f"the rows of {source.location} are preference pairs (columns: "
                                f"{', '.join(columns)})", "add --preference dpo (or ipo, simpo, orpo) to tune on them "
                                "(docs/PREFERENCE.md)"))
    return resolve_example_format(cfg_data, source, columns=columns or None)


def is_messages(value) -> bool:
    return (isinstance(value, list) and len(value) > 0 and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value))


def common_prefix(chosen, rejected) -> int:
    """How many leading items (messages, or characters) two answers share; of strings, a space just before the first
    difference stays with the answers (trl.extract_prompt)."""
    index = 0
    while index < min(len(chosen), len(rejected)) and chosen[index] == rejected[index]:
        index += 1
    if isinstance(chosen, str) and index and chosen[index - 1] == " ":
        index -= 1
    return index


def pair_parts(row: dict) -> tuple:
    """(prompt, chosen, rejected) of a checked row: three strings, or three lists of messages; an implicit prompt is
    the answers' common prefix."""
    chosen, rejected = row["chosen"], row["rejected"]
    if row.get("prompt") is not None:
        return row["prompt"], chosen, rejected
    shared = common_prefix(chosen, rejected)
    return chosen[:shared], chosen[shared:], rejected[shared:]


def _turn(messages: list, index: int) -> str:
    content = " ".join(messages[index]["content"].split())
    return f"{messages[index]['role']}: {content[:40] + '...' if len(content) > 40 else content!r}"


def check_pair_row(row: dict, number: int, source: str) -> None:
    """Raise DataError when row `number` (1-based) of `source` is not a preference pair: a missing answer, values of
    mixed kinds, conversational answers without an assistant turn, answers that are the same, or two conversations
    (an implicit prompt) that differ before the assistant's turn, so that they answer different prompts."""
    missing = [c for c in PAIR_COLUMNS if row.get(c) in (None, [], "")]
    if missing:
        found = [c for c, v in row.items() if v not in (None, [], "")]
        raise row_problem(source, number, f"has no {' and no '.join(missing)} (columns with values: "
                          f"{', '.join(found) or 'none'})", f"give every row both answers: {ROW_SHAPE}")
    chosen, rejected, prompt = row["chosen"], row["rejected"], row.get("prompt")
    text = isinstance(chosen, str) and isinstance(rejected, str) and (prompt is None or isinstance(prompt, str))
    chat = is_messages(chosen) and is_messages(rejected) and (prompt is None or is_messages(prompt))
    if not (text or chat):
        kinds = ", ".join(type(v).__name__ for v in (prompt, chosen, rejected) if v is not None)
        raise row_problem(source, number, f"`prompt`, `chosen` and `rejected` are not all strings nor all lists of "
                          f"{{role, content}} messages ({kinds})", f"write the row as {ROW_SHAPE}")
    _, chosen, rejected = pair_parts(row)
    if chosen == rejected:
        raise row_problem(source, number, "the chosen and the rejected answer are the same",
                          "remove the row: a pair teaches only where its answers differ")
    if chat:
        for name, answer in (("chosen", chosen), ("rejected", rejected)):
            if not any(m["role"] == "assistant" for m in answer):
                raise row_problem(source, number, f"the {name} answer holds no assistant message"
                                  + (" after the turns both answers share" if prompt is None else ""),
                                  "give each answer the assistant's turn")
        if prompt is None and (chosen[0]["role"] != "assistant" or rejected[0]["role"] != "assistant"):
            shared = len(row["chosen"]) - len(chosen)
            raise row_problem(source, number, f"the chosen and rejected conversations differ at message {shared + 1}, "
                              f"before the assistant's answer ({_turn(row['chosen'], shared)} against "
                              f"{_turn(row['rejected'], shared)}): they answer two prompts, and a pair scores two "
                              "answers to one", "give both conversations the same turns up to the assistant's answer, "
                              "or put the prompt's messages in a `prompt` column and only the answers in `chosen` and "
                              "`rejected`")


def check_pair_rows(rows, source: str) -> int:
    """Check every row (DataError at the first bad one); returns the count."""
    count = 0
    for count, row in enumerate(rows, start=1):
        check_pair_row(row, count, source)
    return count
