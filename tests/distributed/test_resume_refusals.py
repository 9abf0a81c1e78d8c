"""A resume whose block length or data differ from the checkpoint's: its data position (blocks of its seq_len in its
training tokens) would name other tokens, so both ranks refuse with the setting, both values and the fix, before the
model is built, and nothing saved changes."""

from __future__ import annotations

import json
import os
import shutil

from conftest import run_trainer
from test_training import RESUME_ARGS, baseline  # noqa: F401 (the fixture)


def _resumable(baseline, tmp_path):
    """The baseline's checkpoints without step 10: a run of RESUME_ARGS resumes from step 5."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(baseline.checkpoint_dir, ckpt)
    shutil.rmtree(ckpt / "step-00000010")
    (ckpt / "latest").write_text("step-00000005")
    return ckpt


def _refused(run, ckpt, before):
    assert run.returncodes == [2, 2], run.output[-3000:]
    assert "Traceback" not in run.outputs[0] + run.outputs[1]
    assert "resume: continuing from" not in run.output
    assert sorted(os.listdir(ckpt)) == before and (ckpt / "latest").read_text() == "step-00000005"


def test_another_seq_len_is_refused_with_both_values(baseline, tmp_path):
    ckpt = _resumable(baseline, tmp_path)
    before = sorted(os.listdir(ckpt))
    args = [a if a != "64" else "32" for a in RESUME_ARGS]  # --seq_len 32 where the checkpoint has 64
    run = run_trainer(ckpt, args)
    _refused(run, ckpt, before)
    assert (f"--seq_len = 32: {ckpt / 'step-00000005'} was trained with --seq_len 64: its data position counts "
            "blocks of 64 tokens, which name other tokens in blocks of 32\n"
            "    fix: resume with --seq_len 64, or start a new run in another --checkpoint_dir") in run.output
    assert run.output.count("was trained with --seq_len 64") == 1  # rank 0 reports for both


def test_other_training_data_are_refused_with_both_values(baseline, tmp_path):
    """The same --dataset (the embedded corpus) cut to its first 300 documents: other training tokens."""
    ckpt = _resumable(baseline, tmp_path)
    before = sorted(os.listdir(ckpt))
    recorded = baseline.checkpoint_dir / "step-00000005" / "manifest.json"
    data = json.loads(recorded.read_text())["data"]
    run = run_trainer(ckpt, [*RESUME_ARGS, "--max_documents", "300"])
    _refused(run, ckpt, before)
    message = next(line for line in run.output.splitlines() if "was trained on other training tokens" in line)
    assert message.startswith(f"  - --dataset = (the embedded corpus): {ckpt / 'step-00000005'} was trained on other "
                              f"training tokens (the embedded corpus: {data['tokens']:,} tokens, digest "
                              f"{data['fingerprint']}; this run: the embedded corpus: "), message
    assert "fix: resume with the data (and --max_documents, --text_column) the checkpoint was trained on, or start " \
           "a new run in another --checkpoint_dir" in run.output
