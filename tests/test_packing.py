"""Packing and sharding: every token used once, EOS between documents, disjoint and complete rank shards."""

from __future__ import annotations

import json

import numpy as np
import pytest

from model_utils.arguments import TrainConfig
from model_utils.concat_dataset import (BlockOrder, DataError, DataPosition, PackedTokens, build_token_files,
                                        open_packed, resolve_source, tokenize_split, write_token_file)
from model_utils.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)


def test_blocks_cover_every_token_once_as_a_target():
    tokens = np.arange(1000, dtype=np.uint32)
    packed = PackedTokens(tokens, seq_len=64)
    assert packed.num_blocks == (1000 - 1) // 64
    targets = np.concatenate([packed.block(i)[1:] for i in range(packed.num_blocks)])
    inputs = np.concatenate([packed.block(i)[:-1] for i in range(packed.num_blocks)])
    assert all(len(packed.block(i)) == 65 for i in range(packed.num_blocks))
    # Every token after the first is a target exactly once, in order; the only loss is the final partial block.
    np.testing.assert_array_equal(targets, tokens[1:packed.num_blocks * 64 + 1])
    np.testing.assert_array_equal(inputs, tokens[:packed.num_blocks * 64])
    assert len(tokens) - 1 - len(targets) < 64


def test_eos_separates_documents_and_nothing_is_truncated(tokenizer, tmp_path):
    import datasets

    docs = ["First document about lists.", "A second, longer document about dictionaries and sets.", "", "Third."]
    tokenized = tokenize_split(datasets.Dataset.from_dict({"text": docs}), tokenizer, "text", 1, "train")
    path = tmp_path / "train.bin"
    n = write_token_file(tokenized, path, np.uint16)
    flat = np.fromfile(path, dtype=np.uint16)
    expected = []
    for d in docs:
        ids = tokenizer(d, add_special_tokens=False)["input_ids"]
        if ids:
            expected += ids + [tokenizer.eos_token_id]
    assert n == len(flat) == len(expected)
    np.testing.assert_array_equal(flat, expected)
    assert (flat == tokenizer.eos_token_id).sum() == 3  # the empty document contributes nothing


@pytest.mark.parametrize("world,micro", [(1, 4), (2, 2), (3, 2), (4, 1)])
def test_rank_shards_are_disjoint_and_complete(world, micro):
    order = BlockOrder(np.arange(101), seed=7, world_size=world, micro_batch=micro)
    seen = {r: [] for r in range(world)}
    pos = DataPosition()
    for _ in range(order.global_batches_per_epoch):
        for r in range(world):
            seen[r] += order.rank_indices(pos, r).tolist()
        pos = order.advance(pos)
    assert pos == DataPosition(1, 0)  # the epoch ended exactly here
    everything = sum(seen.values(), [])
    assert len(everything) == len(set(everything))  # disjoint
    covered = order.global_batches_per_epoch * world * micro
    assert sorted(everything) == sorted(order.permutation(0)[:covered].tolist())  # complete up to the remainder
    assert 101 - covered < world * micro


def test_order_is_deterministic_per_seed_and_epoch_and_independent_of_world_size():
    ids = np.arange(64)
    a, b = BlockOrder(ids, 3, 2, 2), BlockOrder(ids, 3, 2, 2)
    np.testing.assert_array_equal(a.permutation(0), b.permutation(0))
    assert not np.array_equal(a.permutation(0), a.permutation(1))
    assert not np.array_equal(a.permutation(0), BlockOrder(ids, 4, 2, 2).permutation(0))

    def global_sequence(world, micro, n_blocks):
        order, pos, out = BlockOrder(ids, 3, world, micro), DataPosition(), []
        while len(out) < n_blocks:
            out += sum((order.rank_indices(pos, r).tolist() for r in range(world)), [])
            pos = order.advance(pos)
        return out[:n_blocks]

    assert global_sequence(2, 2, 32) == global_sequence(4, 1, 32) == global_sequence(1, 4, 32)


def test_local_formats_and_validation_split(tmp_path, tokenizer):
    import datasets

    train = [f"Document number {i} talks about iterators and generators." for i in range(50)]
    val = [f"Held-out document {i}." for i in range(10)]
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": train}),
                          "validation": datasets.Dataset.from_dict({"text": val})}).save_to_disk(tmp_path / "saved")
    (tmp_path / "jsonl").mkdir()
    (tmp_path / "jsonl" / "part.jsonl").write_text("".join(json.dumps({"content": t}) + "\n" for t in train))
    (tmp_path / "a.txt").write_text("\n".join(train))
    datasets.Dataset.from_dict({"text": train}).to_parquet(str(tmp_path / "data.parquet"))

    for dataset, column, has_val in (("saved", "text", True), ("jsonl", "content", False),
                                     ("a.txt", "text", False), ("data.parquet", "text", False)):
        cfg = TrainConfig(dataset=str(tmp_path / dataset), text_column=column, data_cache_dir=str(tmp_path / "cache"),
                          validation_fraction=0.1)
        out = tmp_path / "packed" / dataset
        build_token_files(cfg, tokenizer, out, log=lambda *_: None)
        data = open_packed(cfg, out, seq_len=16)
        assert (out / "validation.bin").exists() == has_val, dataset
        assert len(data.train_ids) > 0 and len(data.val_ids) > 0
        if not has_val:  # held-out blocks are disjoint from training blocks
            assert not set(data.train_ids) & set(data.val_ids)


@pytest.mark.parametrize("case", ["missing_path", "no_files", "missing_column", "empty"])
def test_bad_data_gets_a_clear_message(case, tmp_path, tokenizer):
    import datasets

    if case == "missing_path":
        cfg = TrainConfig(dataset=str(tmp_path / "nope"), local_dataset="true")
        setting, words = "--dataset", "does not exist"
    elif case == "no_files":
        (tmp_path / "empty_dir").mkdir()
        cfg = TrainConfig(dataset=str(tmp_path / "empty_dir"))
        setting, words = "--dataset", "holds no dataset files"
    elif case == "missing_column":
        datasets.Dataset.from_dict({"body": ["x y z"]}).save_to_disk(tmp_path / "d")
        cfg = TrainConfig(dataset=str(tmp_path / "d"))
        setting, words = "--text_column", "columns: body"
    else:
        datasets.Dataset.from_dict({"text": []}).save_to_disk(tmp_path / "d")
        cfg = TrainConfig(dataset=str(tmp_path / "d"))
        setting, words = "--dataset", "empty"
    with pytest.raises(DataError) as err:
        resolve_source(cfg)
        build_token_files(cfg, tokenizer, tmp_path / "out", log=lambda *_: None)
    assert err.value.problem.setting == setting
    assert words in str(err.value)
    assert "fix:" in str(err.value)
