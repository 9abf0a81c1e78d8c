"""Preference pairs: the rows TRL reads (explicit and implicit prompts, text and conversations) and their errors,
the answer tokens of each sequence, truncation as TRL's collator truncates, pairs packed whole with positions
restarting per sequence, the cache, and the embedded pairs."""

from __future__ import annotations

import json

import numpy as np
import pytest

from model_utils.config.preference import pair_block_len
from model_utils.config.settings import DataConfig
from model_utils.data.errors import DataError
from model_utils.data.preference.cache import PairSettings, build_pair_files, open_pairs
from model_utils.data.preference.encode import PairEncoder
from model_utils.data.preference.formats import check_pair_row, pair_parts, resolve_run_format
from model_utils.data.preference.packing import PackedPairs, cut, pack_pairs
from model_utils.data.sft.formats import IGNORE_INDEX
from model_utils.data.sources import DataSource
from model_utils.data.tokenizer import load_tokenizer

PROMPT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
CHOSEN = [{"role": "assistant", "content": "Four."}]
REJECTED = [{"role": "assistant", "content": "Five, I think."}]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)


@pytest.fixture(scope="module")
def trl():
    """TRL, the reference for how rows are read and cut (imported once: it takes seconds)."""
    return pytest.importorskip("trl")


def answer_text(tokenizer, example) -> str:
    return tokenizer.decode([i for i, label in zip(example.ids, example.labels) if label != IGNORE_INDEX])


# ---- rows -----------------------------------------------------------------------------------------------------------
def test_an_implicit_prompt_is_the_turns_both_conversations_share():
    row = {"chosen": PROMPT + CHOSEN, "rejected": PROMPT + REJECTED}
    assert pair_parts(row) == (PROMPT, CHOSEN, REJECTED)
    assert pair_parts({"prompt": PROMPT, "chosen": CHOSEN, "rejected": REJECTED}) == (PROMPT, CHOSEN, REJECTED)


def test_an_implicit_text_prompt_is_the_shared_start_as_trl_extracts_it(trl):
    row = {"chosen": "The sky is blue.", "rejected": "The sky is green."}
    assert pair_parts(row) == tuple(trl.extract_prompt(row)[k] for k in ("prompt", "chosen", "rejected"))
    assert pair_parts(row) == ("The sky is", " blue.", " green.")


@pytest.mark.parametrize("row, message", [
    ({"prompt": "Hi", "chosen": "Hello."}, "has no rejected (columns with values: prompt, chosen)"),
    ({"prompt": "Hi", "chosen": "Hello.", "rejected": CHOSEN}, "not all strings nor all lists"),
    ({"prompt": "Hi", "chosen": "Same.", "rejected": "Same."}, "the chosen and the rejected answer are the same"),
    ({"chosen": PROMPT + CHOSEN, "rejected": PROMPT + [{"role": "user", "content": "?"}]},
     "the rejected answer holds no assistant message after the turns both answers share"),
    ({"chosen": PROMPT + CHOSEN, "rejected": PROMPT[:1] + [{"role": "user", "content": "Name a colour."}] + REJECTED},
     "differ at message 2, before the assistant's answer (user: 'What is 2+2?' against user: 'Name a colour.')"),
    ({"chosen": PROMPT + CHOSEN, "rejected": [{"role": "system", "content": "Be kind."}] + PROMPT[1:] + REJECTED},
     "differ at message 1, before the assistant's answer (system: 'Be brief.' against system: 'Be kind.')"),
])
def test_a_row_that_is_no_pair_is_named_with_its_fix(row, message):
    with pytest.raises(DataError) as error:
        check_pair_row(row, 7, "pairs.jsonl")
    assert error.value.problem.value == "pairs.jsonl, row 7" and message in error.value.problem.message
    assert error.value.problem.fix


def test_conversations_that_share_no_prompt_are_refused_before_any_pair_is_packed(tokenizer, tmp_path):
    """Two conversations (an implicit prompt) with different user turns share no prompt: the pair would score two
    answers to two prompts against each other. The file's row is named with what differs and the fix."""
    good = {"chosen": PROMPT + CHOSEN, "rejected": PROMPT + REJECTED}
    other = {"chosen": [{"role": "user", "content": "What is 2+2?"}] + CHOSEN,
             "rejected": [{"role": "user", "content": "Name a colour."}] + REJECTED}
    with pytest.raises(DataError) as error:
        build_pair_files({"train": [good, other], "validation": None}, tokenizer, PairSettings(64), tmp_path / "c",
                         "pairs.jsonl", log=lambda *_: None)
    problem = error.value.problem
    assert problem.setting == "--dataset" and problem.value == "pairs.jsonl (train split), row 2"
    assert problem.message.startswith("the chosen and rejected conversations differ at message 1, before the "
                                      "assistant's answer (user: 'What is 2+2?' against user: 'Name a colour.')")
    assert "the same turns" in problem.fix and "`prompt` column" in problem.fix
    assert not (tmp_path / "c" / "meta.json").exists()
    check_pair_row({"prompt": other["chosen"][:1], "chosen": CHOSEN, "rejected": REJECTED}, 2, "pairs.jsonl")  # fixed


def test_rows_and_preference_flag_must_agree_with_the_columns_named(tmp_path):
    pairs, chats = tmp_path / "pairs.jsonl", tmp_path / "chats.jsonl"
    pairs.write_text(json.dumps({"prompt": "Hi", "chosen": "Hello.", "rejected": "Go away."}) + "\n")
    chats.write_text(json.dumps({"messages": PROMPT + CHOSEN}) + "\n")
    source = DataSource("files", str(pairs), files=[str(pairs)], builder="json")
    assert resolve_run_format(DataConfig(), source, preference_on=True) == "preference"
    with pytest.raises(DataError) as error:
        resolve_run_format(DataConfig(), source, preference_on=False)
    assert error.value.problem.setting == "--preference" and "prompt, chosen, rejected" in error.value.problem.message
    assert "--preference dpo" in error.value.problem.fix
    with pytest.raises(DataError) as error:
        resolve_run_format(DataConfig(), DataSource("files", str(chats), files=[str(chats)], builder="json"), True)
    assert "no chosen and rejected columns (columns: messages)" in error.value.problem.message


# ---- sequences ------------------------------------------------------------------------------------------------------
def test_each_sequence_has_loss_on_its_answer_and_the_same_prompt(tokenizer):
    encoder = PairEncoder(tokenizer)
    pair = encoder.encode({"prompt": PROMPT, "chosen": CHOSEN, "rejected": REJECTED}, 1)
    assert answer_text(tokenizer, pair.chosen) == "Four." + tokenizer.eos_token
    assert answer_text(tokenizer, pair.rejected) == "Five, I think." + tokenizer.eos_token
    first = pair.chosen.labels.index(next(label for label in pair.chosen.labels if label != IGNORE_INDEX))
    assert pair.chosen.ids[:first] == pair.rejected.ids[:first]  # the prompt, with the generation prompt
    assert tokenizer.decode(pair.chosen.ids[:first]).endswith("<|im_start|>assistant\n")


def test_a_text_answer_ends_with_one_eos_given_or_not(tokenizer):
    encoder = PairEncoder(tokenizer)
    plain = encoder.encode({"prompt": "Q: 2+2?\nA:", "chosen": " 4", "rejected": " 5"}, 1)
    given = encoder.encode({"prompt": "Q: 2+2?\nA:", "chosen": " 4" + tokenizer.eos_token, "rejected": " 5"}, 1)
    assert plain.chosen.ids == given.chosen.ids and plain.chosen.ids[-1] == tokenizer.eos_token_id
    assert answer_text(tokenizer, plain.rejected) == " 5" + tokenizer.eos_token


def test_truncation_keeps_the_answer_tokens_trls_collator_keeps(tokenizer, trl):
    """keep_start at max_length, per sequence: the targets carrying loss are TRL's completion tokens after its cut
    (its shifted completion mask), for a short, a cut and a fully cut answer."""
    import torch
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    encoder = PairEncoder(tokenizer)
    long_answer = " ".join(["word"] * 40)
    rows = [{"prompt": "Q: say a word\nA:", "chosen": " word", "rejected": long_answer},
            {"prompt": " ".join(["long"] * 30), "chosen": long_answer, "rejected": " no"}]
    max_length = 24
    collator = DataCollatorForPreference(pad_token_id=0, max_length=max_length)
    for row in rows:
        pair = encoder.encode(row, 1)
        examples = []
        for example in (pair.chosen, pair.rejected):
            start = next(i for i, label in enumerate(example.labels) if label != IGNORE_INDEX)
            examples.append((example.ids[:start], example.ids[start:]))
        batch = collator([{"prompt_ids": examples[0][0], "chosen_ids": examples[0][1], "rejected_ids": examples[1][1]}])
        for side, example in enumerate((pair.chosen, pair.rejected)):
            mask = batch["completion_mask"][side][1:].bool()
            trl_targets = batch["input_ids"][side][1:][mask].tolist()
            ours = cut(example, max_length)
            assert (ours[1][ours[1] != IGNORE_INDEX].tolist() if ours else []) == trl_targets
    assert cut(encoder.encode(rows[1], 1).chosen, 8) is None  # the prompt alone fills max_length: TRL drops it
    assert torch.is_tensor(batch["input_ids"])


# ---- packing --------------------------------------------------------------------------------------------------------
def pairs_of(tokenizer, count: int):
    encoder = PairEncoder(tokenizer)
    return [encoder.encode({"prompt": f"Q{i}: what is {i} plus {i}?\nA:", "chosen": f" {2 * i}.",
                            "rejected": f" {2 * i + 1}, or so" + " so" * (i % 5)}, i + 1) for i in range(count)]


def test_pairs_are_packed_whole_chosen_then_rejected_positions_restarting(tokenizer):
    max_length = 32
    pairs = pairs_of(tokenizer, 12)
    by_chosen = {tuple(pair.chosen.ids[:-1]): pair for pair in pairs}  # each prompt differs
    packed = pack_pairs(pairs, max_length, 0, len(tokenizer))
    block_len = pair_block_len(max_length)
    assert packed.stats.pairs == 12 and packed.stats.dropped == 0 and packed.pair_offsets[-1] == 12
    data = PackedPairs(packed.inputs, packed.targets, packed.positions, packed.pair_offsets, block_len)
    batch = data.batch(range(data.num_blocks))
    assert batch.input_ids.shape == (data.num_blocks, block_len) and batch.num_pairs == 12
    segment_ids = batch.segment_ids()
    flat = {name: getattr(batch, name).reshape(-1) for name in ("input_ids", "targets", "position_ids")}
    found = []
    for number, chosen, rejected, row in batch.pairs:
        original = by_chosen[tuple(flat["input_ids"][segment_ids == chosen].tolist())]
        found.append(original)
        for segment, example in ((chosen, original.chosen), (rejected, original.rejected)):
            where = segment_ids == segment
            assert flat["input_ids"][where].tolist() == example.ids[:-1]
            assert flat["targets"][where].tolist() == example.labels[1:]
            assert flat["position_ids"][where].tolist() == list(range(len(example.ids) - 1))
            assert (np.flatnonzero(where) // block_len == row).all()  # both in the pair's row
        assert rejected == chosen + 1  # side by side
    assert len({id(pair) for pair in found}) == 12 and sorted(batch.pairs[:, 0].tolist()) == list(range(12))


def test_a_pair_without_an_answer_token_within_max_length_is_dropped_and_counted(tokenizer):
    pairs = pairs_of(tokenizer, 3)
    encoder = PairEncoder(tokenizer)
    pairs.append(encoder.encode({"prompt": "word " * 40, "chosen": " yes", "rejected": " no"}, 4))
    packed = pack_pairs(pairs, 24, 0, len(tokenizer))
    assert packed.stats.pairs == 3 and packed.stats.dropped == 1
    assert "1 dropped without an answer token" in packed.stats.describe()


def test_a_pairs_file_is_packed_into_the_cache_with_a_held_out_split(tokenizer, tmp_path):
    rows = [{"prompt": f"Q{i}: what is {i} plus {i}?\nA:", "chosen": f" {2 * i}.", "rejected": f" {2 * i + 1}."}
            for i in range(40)]
    meta = build_pair_files({"train": rows, "validation": None}, tokenizer, PairSettings(32), tmp_path / "c", "p",
                            log=lambda *_: None)
    data = open_pairs(tmp_path / "c", validation_fraction=0.25)
    assert meta["splits"]["train"]["stats"]["pairs"] == 40
    assert "preference pairs (text: prompt, answer, EOS): 40 pairs" in data.description
    assert len(data.val_ids) > 0 and not set(data.train_ids) & set(data.val_ids)
    assert data.train.seq_len == 64 and data.train.num_pairs == 40
