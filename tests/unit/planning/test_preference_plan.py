"""The plan of a preference run: --seq_len bounds each sequence of a pair and a block holds 2 x seq_len positions
(the batch, the memory and the automatic micro-batch count blocks of pairs); the preflight describes the pairs and
holds --seq_len, not the block, to the model's positions."""

from __future__ import annotations

import json

import pytest

from model_utils.config.flags import parse_args
from model_utils.planning.preflight import run_preflight


@pytest.fixture(scope="module")
def pairs_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("pairs") / "pairs.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"What is {i} plus {i}?", "chosen": f" {2 * i}.",
                                        "rejected": f" {2 * i + 1}."}) + "\n" for i in range(64)))
    return path


def test_a_block_holds_a_pair_of_sequences_of_seq_len(pairs_file, tmp_path):
    """The tiny preset's positions end at 2,048: sequences of 1,500 tokens fit it in blocks of 3,000 positions (each
    sequence counts from 0), sequences of 2,100 do not. Two preflights; a first one in a process imports torch and
    DeepSpeed, most of its time."""
    def preflight(seq_len: int):
        return run_preflight(parse_args(["--preference", "dpo", "--dataset", str(pairs_file), "--seq_len", str(seq_len),
                                         "--micro_batch_size", "1", "--checkpoint_dir", str(tmp_path / "c")]),
                             world_size=1)

    report = preflight(1500)
    assert not report.problems, report.problems
    text = "\n".join(report.lines)
    assert "batch: micro 1 x grad_acc 1 x world 1 = 1 blocks of 3000 tokens" in text
    assert "preference pairs (text: prompt, answer, EOS), 64 rows" in text and "blocks of 3000" in text
    assert [p.value for p in preflight(2100).problems if p.setting == "--seq_len"] == [2100]
