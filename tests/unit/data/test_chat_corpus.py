"""The embedded fine-tuning dataset: chats about standard-library functions answered by their docstrings."""

from __future__ import annotations

import inspect
import json
import textwrap

import pytest

from model_utils.data.chat_corpus import build_sft_corpus, select_examples, split_files
from model_utils.data.sft.encode import ExampleEncoder, encode_rows
from model_utils.data.sft.formats import IGNORE_INDEX
from model_utils.data.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return build_sft_corpus(tmp_path_factory.mktemp("sft-corpus"))


@pytest.fixture(scope="module")
def selection():
    return select_examples()


def rows(corpus, split):
    return [json.loads(line) for line in open(split_files(corpus)[split], encoding="utf-8")]


def test_a_few_thousand_chats_split_by_function_without_overlap(corpus):
    train, validation = rows(corpus, "train"), rows(corpus, "validation")
    assert 2000 <= len(train) + len(validation) <= 4000 and 0.02 < len(validation) / len(train) < 0.1
    questions = lambda split: {r["messages"][1]["content"] for r in split}  # noqa: E731
    assert not questions(train) & questions(validation)


def test_the_dataset_is_the_same_on_every_build(corpus, tmp_path):
    """A second build from scratch gives the same bytes (~5 s: the build parses the standard library's sources)."""
    again = build_sft_corpus(tmp_path)
    for split, path in split_files(corpus).items():
        assert open(path, "rb").read() == open(split_files(again)[split], "rb").read()


def test_fewer_examples_keep_the_same_split_for_the_functions_they_share(selection):
    full, small = selection, select_examples(300)
    assert sum(len(v) for v in small.values()) == 300
    for split in full:
        assert {f.key for f in small[split]} <= {f.key for f in full[split]}


def test_an_answer_is_the_functions_docstring(selection):
    import importlib

    chosen = {f.key: f for split in selection.values() for f in split}
    function = next(f for key, f in chosen.items() if key.startswith("json.") and "." not in f.name)
    real = getattr(importlib.import_module(function.module), function.name)
    assert function.doc == inspect.getdoc(real)
    user, answer = function.messages()[1:]
    assert f"{function.name}(" in user["content"] and function.module in user["content"]
    assert answer == {"role": "assistant", "content": function.doc}


def test_methods_are_asked_about_without_self_and_private_names_are_left_out(tmp_path):
    from model_utils.data.chat_corpus import documented_functions

    source = textwrap.dedent('''
        class Queue:
            def put(self, item, block=True, timeout=None):
                """Put an item into the queue, waiting for a free slot when block is true and timeout is None."""
        def _hidden(x):
            """A private helper that no user calls, with a docstring long enough to be kept otherwise."""
        ''')
    (tmp_path / "toyqueue.py").write_text(source)
    found = list(documented_functions(tmp_path / "toyqueue.py", tmp_path))
    assert [(f.module, f.name, f.signature) for f in found] == [("toyqueue", "Queue.put",
                                                                "item, block=True, timeout=None")]


def test_every_row_is_a_chat_whose_loss_is_the_docstring(corpus):
    tokenizer = load_tokenizer(None)
    encoder = ExampleEncoder(tokenizer, "chat", source="validation.jsonl")
    validation = rows(corpus, "validation")
    for row, example in zip(validation, encode_rows(validation, encoder)):
        answer = tokenizer.decode([i for i, label in zip(example.ids, example.labels) if label != IGNORE_INDEX])
        assert answer == row["messages"][2]["content"] + tokenizer.eos_token


def test_the_preference_pairs_are_the_chats_with_their_answer_in_capitals_rejected(selection, tmp_path):
    """One pair per chat of each split, its questions and answer the chat's: the held-out pairs ask what neither the
    fine-tuning nor the preference tuning saw."""
    from model_utils.data.chat_corpus import build_preference_corpus

    corpus = build_preference_corpus(tmp_path)
    for split in ("train", "validation"):
        functions, pairs = selection[split], rows(corpus, split)
        assert len(pairs) == len(functions) > 0
        for function, row in zip(functions, pairs):
            assert row["prompt"] + row["chosen"] == function.messages()  # the chat, its answer chosen
            answer = row["chosen"][0]["content"]
            assert row["rejected"] == [{"role": "assistant", "content": answer.upper()}] and answer.upper() != answer
