"""Starting from a checkpoint directory a crash left behind: `latest` of any content, incomplete checkpoints moved
aside (never deleted, never blocking a start). The checkpoints here are real directories with a manifest written as
commit_save writes it; what DeepSpeed puts in the files does not matter to finding one."""

from __future__ import annotations

import json

import pytest

from model_utils.checkpoint.protocol import (ResumeError, find_resume_checkpoint, move_incomplete_aside, read_latest,
                                             resolve_explicit)
from model_utils.core.run_dir import INCOMPLETE, LATEST, MANIFEST, checkpoint_name


def complete(ckpt, step: int):
    path = ckpt / checkpoint_name(step)
    path.mkdir(parents=True)
    (path / "mp_rank_00_model_states.pt").write_bytes(b"x" * 100)
    (path / MANIFEST).write_text(json.dumps({"step": step, "files": {"mp_rank_00_model_states.pt": 100}}))
    return path


def incomplete(ckpt, step: int):
    path = ckpt / checkpoint_name(step)
    path.mkdir(parents=True)
    (path / "mp_rank_00_model_states.pt").write_bytes(b"x" * 50)  # the save died before its manifest
    return path


@pytest.fixture
def ckpt(tmp_path):
    d = tmp_path / "ckpt"
    complete(d, 2)
    complete(d, 4)
    incomplete(d, 6)
    return d


@pytest.mark.parametrize("content, words", [
    (b"\x89\xffstep-\x00\x01", "bytes that are not text"),
    (b"", "is empty"),
    (b"  \n", "is empty"),
    (b"hello", "not a checkpoint name"),
    (b"step-00000099", "names step-00000099, which does not exist"),
    (b"step-00000006", "names step-00000006, which is incomplete"),
], ids=["binary", "empty", "blank", "not-a-tag", "missing", "incomplete"])
def test_latest_of_any_content_falls_back_to_the_newest_complete_checkpoint(ckpt, content, words):
    (ckpt / LATEST).write_bytes(content)
    warnings = []
    assert find_resume_checkpoint(ckpt, warnings.append).path.name == "step-00000004"
    assert words in warnings[0] and "looking for the newest complete checkpoint instead" in warnings[0], warnings
    assert read_latest(ckpt)[0] is None


def test_latest_as_a_directory_falls_back_too(ckpt):
    (ckpt / LATEST).mkdir()
    warnings = []
    assert find_resume_checkpoint(ckpt, warnings.append).path.name == "step-00000004"
    assert "is a directory" in warnings[0]


def test_a_good_latest_is_read_without_a_warning(ckpt):
    (ckpt / LATEST).write_text("step-00000004")
    warnings = []
    assert read_latest(ckpt) == ("step-00000004", None)
    assert find_resume_checkpoint(ckpt, warnings.append).path.name == "step-00000004"
    assert warnings == ["skipping incomplete checkpoint step-00000006: "
                        f"{ckpt / 'step-00000006' / MANIFEST} is missing (the save did not finish)"]


def test_incomplete_checkpoints_are_moved_aside_and_kept(ckpt):
    truncated = complete(ckpt, 8)
    (truncated / "mp_rank_00_model_states.pt").write_bytes(b"x" * 10)  # damaged after its manifest
    warnings = []
    moved = move_incomplete_aside(ckpt, warnings.append)
    assert [line.split(" ")[0] for line in moved] == ["step-00000008", "step-00000006"]
    assert "has 10 bytes, the manifest recorded 100" in moved[0] and "manifest.json is missing" in moved[1]
    assert all(w.startswith("checkpoint: incomplete checkpoint moved aside: ") for w in warnings)
    assert sorted(p.name for p in ckpt.glob("step-*")) == ["step-00000002", "step-00000004"]
    aside = ckpt / INCOMPLETE
    assert (aside / "step-00000006" / "mp_rank_00_model_states.pt").stat().st_size == 50  # kept as it was
    assert (aside / "step-00000008" / MANIFEST).exists()
    assert find_resume_checkpoint(ckpt, warnings.append).path.name == "step-00000004"


def test_the_same_step_cut_short_twice_is_kept_twice(tmp_path):
    ckpt = tmp_path / "ckpt"
    incomplete(ckpt, 2)
    assert move_incomplete_aside(ckpt, print) == [f"step-00000002 -> {INCOMPLETE}/step-00000002 "
                                                  f"({ckpt / 'step-00000002' / MANIFEST} is missing (the save did "
                                                  "not finish))"]
    incomplete(ckpt, 2)
    moved = move_incomplete_aside(ckpt, print)
    assert moved[0].startswith(f"step-00000002 -> {INCOMPLETE}/step-00000002.1 ")
    assert sorted(p.name for p in (ckpt / INCOMPLETE).iterdir()) == ["step-00000002", "step-00000002.1"]
    assert find_resume_checkpoint(ckpt, print) is None  # nothing complete: the caller starts from step 0


def test_an_explicit_checkpoint_directory_without_a_complete_one_is_refused(tmp_path):
    ckpt = tmp_path / "elsewhere"
    incomplete(ckpt, 2)
    with pytest.raises(ResumeError, match="none of its checkpoints is complete"):
        resolve_explicit(ckpt, print)
    assert (ckpt / "step-00000002").is_dir()  # an explicit source is only read, never tidied


def test_a_resume_in_other_blocks_tokens_or_data_is_refused_naming_both_values(tmp_path):
    """data_position_problems, on the entries save() records in a manifest; one Problem per differing setting."""
    import numpy as np

    from model_utils.checkpoint.protocol import data_position_problems
    from model_utils.data.tokens import token_fingerprint

    tokens = np.arange(300_000, dtype=np.uint16)
    saved = {"seq_len": 256, "tokenizer": None, "tokenizer_identity": "a" * 64,
             "data": {"dataset": "corpus.txt", "tokens": len(tokens), "fingerprint": token_fingerprint(tokens)}}
    path = tmp_path / "step-00000010"
    assert data_position_problems(saved, path, dict(saved)) == []
    assert data_position_problems({"step": 10}, path, dict(saved)) == []  # a manifest without them: not compared
    changed = tokens.copy()
    changed[-1] += 1  # one token of the last piece
    now = dict(saved, seq_len=128, tokenizer="my-tokenizer", tokenizer_identity="b" * 64,
               data={"dataset": "corpus.txt", "tokens": len(changed), "fingerprint": token_fingerprint(changed)})
    seq_len, tokenizer, data = data_position_problems(saved, path, now)
    assert str(seq_len) == (f"--seq_len = 128: {path} was trained with --seq_len 256: its data position counts "
                            "blocks of 256 tokens, which name other tokens in blocks of 128\n"
                            "    fix: resume with --seq_len 256, or start a new run in another --checkpoint_dir")
    assert str(tokenizer).startswith(f"--tokenizer = my-tokenizer: {path} was trained with another tokenizer (the "
                                     f"model's, digest aaaaaaaaaaaa; this run: my-tokenizer, digest bbbbbbbbbbbb)")
    assert str(data).startswith(f"--dataset = corpus.txt: {path} was trained on other training tokens (corpus.txt: "
                                f"300,000 tokens, digest {saved['data']['fingerprint']}; this run: corpus.txt: "
                                f"300,000 tokens, digest {now['data']['fingerprint']})")
    assert saved["data"]["fingerprint"] != now["data"]["fingerprint"]
