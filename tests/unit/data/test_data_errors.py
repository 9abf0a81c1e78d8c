"""Every data failure is a Problem naming the file (and the line where there is one), the setting and the fix, from the
data pipeline itself, from --preflight and from a real run, before any step; never a traceback."""

from __future__ import annotations

import json
import os

import pytest
from inputs import bad_jsonl_line, good_rows, jsonl

from model_utils.config.flags import parse_args
from model_utils.data.errors import DataError
from model_utils.data.loading import load_splits
from model_utils.data.sources import resolve_source
from model_utils.data.tokenizer import load_tokenizer
from model_utils.data.tokens import build_token_files


def json_line_not_an_object(d):
    jsonl(d / "a.jsonl", [*good_rows(10), '["a", "list"]', *good_rows(5)])
    return d / "a.jsonl", "line 11 is not a JSON object (list)"


def broken_json_document(d):
    (d / "a.json").write_text('[{"text": "one"},\n {"text": ')
    return d / "a.json", "is not valid JSON at line 2, column 11"


def csv_field_count(d):
    (d / "a.csv").write_text("text,id\n" + "".join(f"row {i},{i}\n" for i in range(30)) + "oops,1,2\n")
    return d / "a.csv", "line 32 has 3 fields, the header has 2"


def undecodable_text(d):
    (d / "a.txt").write_bytes(b"fine line\n" * 7 + b"caf\xe9 latin-1\n")
    return d / "a.txt", "line 8 is not UTF-8 text"


def corrupt_parquet(d):
    (d / "a.parquet").write_bytes(b"PAR1 this is not really parquet")
    return d / "a.parquet", "is not a readable Parquet file"


CASES = [bad_jsonl_line, json_line_not_an_object, broken_json_document, csv_field_count, undecodable_text,
         corrupt_parquet]


def problem_of(cfg):
    with pytest.raises(DataError) as caught:
        load_splits(resolve_source(cfg), cfg)
    return caught.value.problem


@pytest.mark.parametrize("make", CASES, ids=[c.__name__ for c in CASES])
def test_unparsable_file_is_named_with_its_line(make, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    path, words = make(data)
    problem = problem_of(parse_args(["--dataset", str(data), "--data_cache_dir", str(tmp_path / "cache")]).data)
    assert problem.setting == "--dataset" and problem.value == str(path)
    assert words in problem.message and "run again" in problem.fix


def test_file_changed_while_tokenizing_is_refused_and_its_cache_removed(tmp_path, monkeypatch):
    from model_utils.data import tokens

    data = tmp_path / "data"
    data.mkdir()
    jsonl(data / "a.jsonl", good_rows())
    cfg = parse_args(["--dataset", str(data), "--data_cache_dir", str(tmp_path / "cache")]).data
    original = tokens.tokenize_split

    def tokenize_while_a_writer_appends(*args, **kw):
        with open(data / "a.jsonl", "a") as f:
            f.write(json.dumps({"text": "appended meanwhile"}) + "\n")
        return original(*args, **kw)

    monkeypatch.setattr(tokens, "tokenize_split", tokenize_while_a_writer_appends)
    out = tmp_path / "packed"
    with pytest.raises(DataError) as caught:
        build_token_files(cfg, load_tokenizer(None), out, log=lambda *_: None)
    assert "changed while it was being read and tokenized" in caught.value.problem.message
    assert not out.exists()  # no cache entry keyed by the old contents holds the new ones


def test_file_that_disappears_is_named(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    jsonl(data / "a.jsonl", good_rows())
    jsonl(data / "b.jsonl", good_rows())
    cfg = parse_args(["--dataset", str(data), "--data_cache_dir", str(tmp_path / "cache")]).data
    source = resolve_source(cfg)
    os.remove(data / "b.jsonl")  # listed, then gone (another job cleaning up, a flaky mount)
    with pytest.raises(DataError) as caught:
        build_token_files(cfg, load_tokenizer(None), tmp_path / "packed", log=lambda *_: None, source=source)
    assert caught.value.problem.value == str(data / "b.jsonl") and "disappeared" in caught.value.problem.message


def test_text_that_tokenizes_to_nothing_names_the_column(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    jsonl(data / "a.jsonl", [{"text": 123, "body": "real text"} for _ in range(20)])  # numbers, not text
    cfg = parse_args(["--dataset", str(data), "--data_cache_dir", str(tmp_path / "cache")]).data
    with pytest.raises(DataError) as caught:
        build_token_files(cfg, load_tokenizer(None), tmp_path / "packed", log=lambda *_: None)
    assert "empty after tokenization" in caught.value.problem.message and "'text'" in caught.value.problem.fix


def test_unknown_hub_dataset_is_a_problem_not_a_traceback(tmp_path):
    """The hub is out of reach here (HF_DATASETS_OFFLINE, set by conftest): the same path a wrong name takes."""
    cfg = parse_args(["--dataset", "no-such-org/no-such-dataset", "--local_dataset", "false",
                      "--data_cache_dir", str(tmp_path / "cache")]).data
    problem = problem_of(cfg)
    assert problem.value == "no-such-org/no-such-dataset" and "could not be loaded from the hub" in problem.message
    assert "DATASET_CONFIG_NAME" in problem.fix
