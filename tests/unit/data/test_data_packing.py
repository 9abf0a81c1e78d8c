"""Packing and sharding: every token used once, EOS between documents, disjoint and complete rank shards."""

from __future__ import annotations

import json

import numpy as np
import pytest

from model_utils.config.settings import DataConfig
from model_utils.data.blocks import BlockOrder, DataPosition, PackedTokens
from model_utils.data.errors import DataError
from model_utils.data.pipeline import open_packed
from model_utils.data.sources import resolve_source
from model_utils.data.tokenizer import load_tokenizer
from model_utils.data.tokens import build_token_files, cache_dir_for, tokenize_split, write_token_file


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


TRAIN_DOCS = [f"Document number {i} talks about iterators and generators." for i in range(50)]
VAL_DOCS = [f"Held-out document {i}." for i in range(10)]


def _write_jsonl(path, docs, column="text"):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({column: t}) + "\n" for t in docs))


def _save_with_validation(path):
    import datasets

    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": TRAIN_DOCS}),
                          "validation": datasets.Dataset.from_dict({"text": VAL_DOCS})}).save_to_disk(path)


def test_local_formats_and_validation_split(tmp_path, tokenizer):
    import datasets

    train = TRAIN_DOCS
    _save_with_validation(tmp_path / "saved")
    _write_jsonl(tmp_path / "jsonl" / "part.jsonl", train, column="content")
    (tmp_path / "a.txt").write_text("\n".join(train))
    datasets.Dataset.from_dict({"text": train}).to_parquet(str(tmp_path / "data.parquet"))

    for dataset, column, has_val in (("saved", "text", True), ("jsonl", "content", False),
                                     ("a.txt", "text", False), ("data.parquet", "text", False)):
        cfg = DataConfig(dataset=str(tmp_path / dataset), text_column=column, data_cache_dir=str(tmp_path / "cache"),
                          validation_fraction=0.1)
        out = tmp_path / "packed" / dataset
        build_token_files(cfg, tokenizer, out, log=lambda *_: None)
        data = open_packed(cfg, out, seq_len=16)
        assert (out / "validation.bin").exists() == has_val, dataset
        assert len(data.train_ids) > 0 and len(data.val_ids) > 0
        if not has_val:  # held-out blocks are disjoint from training blocks
            assert not set(data.train_ids) & set(data.val_ids)


def test_max_documents_takes_the_first_documents_of_each_split(tmp_path, tokenizer):
    """--max_documents N: the files are streamed (the code path of hub datasets) and a saved dataset is sliced; either
    way each split holds its first N documents, and the cache key tells the subsets apart."""
    train, val = TRAIN_DOCS, VAL_DOCS
    _save_with_validation(tmp_path / "saved")
    _write_jsonl(tmp_path / "jsonl" / "part.jsonl", train)

    def first_tokens(docs):
        return [t for d in docs for t in tokenizer(d, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]]

    for dataset, splits in (("jsonl", {"train": train}), ("saved", {"train": train, "validation": val})):
        cfg = DataConfig(dataset=str(tmp_path / dataset), data_cache_dir=str(tmp_path / "cache"), max_documents=7)
        out = tmp_path / "packed" / dataset
        build_token_files(cfg, tokenizer, out, log=lambda *_: None)
        meta = json.loads((out / "meta.json").read_text())
        assert meta["documents"] == {"train": 7, "validation": 7 if "validation" in splits else 0}, dataset
        for split, docs in splits.items():
            np.testing.assert_array_equal(np.fromfile(out / f"{split}.bin", dtype=np.uint16), first_tokens(docs[:7]))
        source = resolve_source(cfg)
        everything = DataConfig(dataset=cfg.dataset, data_cache_dir=cfg.data_cache_dir)
        assert cache_dir_for(cfg, source, tokenizer) != cache_dir_for(everything, source, tokenizer)

    # Edited files give the new documents, not datasets' cached copy of the old stream.
    edited = ["An edited first document, longer than before."] + train[1:]
    _write_jsonl(tmp_path / "jsonl" / "part.jsonl", edited)
    cfg = DataConfig(dataset=str(tmp_path / "jsonl"), data_cache_dir=str(tmp_path / "cache"), max_documents=7)
    build_token_files(cfg, tokenizer, tmp_path / "packed" / "edited", log=lambda *_: None)
    np.testing.assert_array_equal(np.fromfile(tmp_path / "packed" / "edited" / "train.bin", dtype=np.uint16),
                                  first_tokens(edited[:7]))


@pytest.mark.parametrize("case", ["missing_path", "no_files", "empty_files", "missing_column", "empty"])
def test_bad_data_gets_a_clear_message(case, tmp_path, tokenizer):
    import datasets

    if case == "missing_path":
        cfg = DataConfig(dataset=str(tmp_path / "nope"), local_dataset="true")
        setting, words = "--dataset", "does not exist"
    elif case == "no_files":
        (tmp_path / "empty_dir").mkdir()
        cfg = DataConfig(dataset=str(tmp_path / "empty_dir"))
        setting, words = "--dataset", "holds no dataset files"
    elif case == "empty_files":
        (tmp_path / "d").mkdir()
        (tmp_path / "d" / "part-0.jsonl").write_text("")
        cfg = DataConfig(dataset=str(tmp_path / "d"), max_documents=5)
        setting, words = "--dataset", "holds only empty files"
    elif case == "missing_column":
        datasets.Dataset.from_dict({"body": ["x y z"]}).save_to_disk(tmp_path / "d")
        cfg = DataConfig(dataset=str(tmp_path / "d"))
        setting, words = "--text_column", "columns: body"
    else:
        datasets.Dataset.from_dict({"text": []}).save_to_disk(tmp_path / "d")
        cfg = DataConfig(dataset=str(tmp_path / "d"))
        setting, words = "--dataset", "empty"
    with pytest.raises(DataError) as err:
        resolve_source(cfg)
        build_token_files(cfg, tokenizer, tmp_path / "out", log=lambda *_: None)
    assert err.value.problem.setting == setting
    assert words in str(err.value)
    assert "fix:" in str(err.value)


def test_document_positions_restart_after_each_eos_and_boundaries_split_every_document():
    from model_utils.data.blocks import attention_area, document_boundaries, document_positions

    eos = 0
    rows = np.array([[5, 6, 0, 7, 0, 0, 8, 9],    # documents: 5 6 <eos> | 7 <eos> | <eos> | 8 9 (cut by the block)
                     [9, 9, 9, 9, 9, 9, 9, 0]])   # one document ending at the block's last token
    positions = document_positions(rows, eos)
    np.testing.assert_array_equal(positions, [[0, 1, 2, 0, 1, 0, 0, 1], [0, 1, 2, 3, 4, 5, 6, 7]])
    boundaries = document_boundaries(positions)
    np.testing.assert_array_equal(boundaries, [0, 3, 5, 6, 8, 16])
    assert boundaries.dtype == np.int32
    # Every token belongs to exactly one document, and no document spans two rows.
    lengths = np.diff(boundaries)
    assert lengths.sum() == rows.size and (lengths > 0).all()
    assert set(boundaries) >= {0, rows.shape[1], rows.size}
    # Attention FLOPs count each document's own square: 3² + 2² + 1² + 2² and 8², against 8² per row across them.
    assert attention_area(positions) == 9 + 4 + 1 + 4 + 64
    assert attention_area(np.broadcast_to(np.arange(8), (2, 8))) == 2 * 64


def test_flops_within_documents_count_each_documents_square():
    from model_utils.models.build import FlopsModel

    fm = FlopsModel(non_embedding_params=1000, num_layers=2, num_heads=4, head_dim=8, seq_len=64)
    assert fm.flops(64, 64 ** 2) == pytest.approx(64 * fm.per_token())  # one block attended across documents
    assert fm.per_token() == 6 * 1000 + 12 * 2 * 4 * 8 * 64
    assert fm.flops(64, 2 * 32 ** 2, 6) == 64 * 6 * 1000 + 6 * 2 * 4 * 8 * 2 * 32 ** 2  # two documents of 32


def test_document_mask_makes_each_document_see_only_itself(tokenizer):
    """The trainer's own model_inputs on the tiny model (SDPA, CPU): with --document_mask every document's logits in a
    packed block equal those of the document run alone; without it the later documents see the earlier ones."""
    from types import SimpleNamespace

    import torch

    from model_utils.models.build import build_model, model_config
    from model_utils.train.step import model_inputs

    torch.manual_seed(0)
    model = build_model("tiny", model_config("tiny", tokenizer), torch.float32, "sdpa", False).eval()
    eos = tokenizer.eos_token_id
    rng = np.random.default_rng(0)
    documents = [np.append(rng.integers(10, 200, n), eos) for n in (6, 11, 0, 14)]
    block = np.concatenate(documents)[:33]  # seq_len 32 + 1; the last document is cut by the block
    blocks = np.stack([block, block[::-1]]).astype(np.int64)

    def run(document_mask: bool):
        fake_run = SimpleNamespace(dist=SimpleNamespace(device=torch.device("cpu"), sequence_parallel=1), seq_len=32,
                                   document_eos=eos if document_mask else None, document_boundaries=False)
        batch = model_inputs(fake_run, blocks)
        assert torch.equal(batch["input_ids"], torch.from_numpy(blocks[:, :-1]))
        assert torch.equal(batch["labels"], torch.from_numpy(blocks[:, 1:]))
        assert ("position_ids" in batch) == document_mask
        with torch.no_grad():
            return model(**{k: v for k, v in batch.items() if k not in ("labels", "shift_labels")}).logits[0]

    masked, plain = run(True), run(False)
    start, worst_masked, worst_plain = 0, 0.0, 0.0
    for doc in documents:
        end = min(start + len(doc), 32)
        with torch.no_grad():
            alone = model(input_ids=torch.from_numpy(blocks[:1, start:end])).logits[0]
        worst_masked = max(worst_masked, (alone - masked[start:end]).abs().max().item())
        if start:
            worst_plain = max(worst_plain, (alone - plain[start:end]).abs().max().item())
        start = end
    assert worst_masked < 1e-4
    assert worst_plain > 0.1  # without the mask the later documents attend to the earlier ones
