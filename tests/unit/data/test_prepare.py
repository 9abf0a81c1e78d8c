"""The preparation (model_utils.prepare) on real files with the shipped tokenizer and real process pools: its token
stream equals the trainer's own tokenization, a killed preparation resumes without redoing finished shards, SLURM tasks
share the shards, and training opens the result (or pre-tokenized data, or a mixture) as it opens raw data."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO, SRC

from model_utils.config.settings import DataConfig
from model_utils.data.blocks import BlockOrder, DataPosition
from model_utils.data.corpus import build_embedded_corpus
from model_utils.data.errors import DataError
from model_utils.data.pipeline import open_source
from model_utils.data.prepare import SHARDS_DIR, Task, prepare
from model_utils.data.sources import MANIFEST, resolve_source
from model_utils.data.tokenizer import load_tokenizer
from model_utils.data.tokens import build_token_files


class OneProcess:
    """A world of one rank (prepare_data's `dist` outside a distributed run)."""

    rank = local_rank = 0
    world_size = 1

    def broadcast_object(self, obj):
        return obj


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)


def corpus_docs() -> list[str]:
    path = build_embedded_corpus()
    return [json.loads(line)["text"] for line in path.read_text(encoding="utf-8").splitlines()]


def test_a_corpus_another_process_put_in_place_first_is_never_replaced(tmp_path, monkeypatch):
    """Two processes that build the embedded corpus at once: the one that finishes second keeps the first one's file
    (the same inode and time), since a process already tokenizing it would see it change and stop; and no temporary
    file is left behind."""
    import model_utils.data.corpus as corpus_module

    first = {}

    def documents_while_another_process_finishes():
        yield "a document of this process"
        # the other process's corpus lands while this one is still writing its own
        out_dir = next(tmp_path.glob("embedded-corpus-*"))
        (out_dir / "corpus.jsonl").write_text(json.dumps({"text": "the other process's corpus"}) + "\n")
        first["stat"] = (out_dir / "corpus.jsonl").stat()

    monkeypatch.setattr(corpus_module, "iter_documents", documents_while_another_process_finishes)
    path = build_embedded_corpus(tmp_path)
    assert json.loads(path.read_text())["text"] == "the other process's corpus"
    assert (path.stat().st_ino, path.stat().st_mtime_ns) == (first["stat"].st_ino, first["stat"].st_mtime_ns)
    assert [p.name for p in path.parent.iterdir()] == ["corpus.jsonl"]
    monkeypatch.setattr(corpus_module, "iter_documents", lambda: iter(["one document"]))
    fresh = build_embedded_corpus(tmp_path / "alone")  # with no other process: its own corpus, in place
    assert json.loads(fresh.read_text())["text"] == "one document" and len(list(fresh.parent.iterdir())) == 1


def write_jsonl_dir(folder: Path, docs: list[str]) -> Path:
    """Two JSONL files, with what the JSON reader skips or empties: a blank line, a record without the text field."""
    folder.mkdir(parents=True)
    half = len(docs) // 2
    for name, part in (("a.jsonl", docs[:half]), ("b.jsonl", docs[half:])):
        lines = [json.dumps({"text": d}) for d in part]
        lines.insert(3, "")
        lines.insert(5, json.dumps({"title": "a record without text"}))
        (folder / name).write_text("\n".join(lines) + "\n", encoding="utf-8")
    return folder


def raw_tokens(tmp_path: Path, cfg: TrainConfig, tokenizer, name="raw") -> np.ndarray:
    out = tmp_path / name
    build_token_files(cfg, tokenizer, out, log=lambda *_: None)
    return np.fromfile(out / "train.bin", dtype=np.uint16)


def prepared_tokens(folder: Path, split="train") -> np.ndarray:
    manifest = json.loads((folder / MANIFEST).read_text())
    dtype = np.dtype(manifest["dtype"])
    return np.concatenate([np.fromfile(folder / s["file"], dtype=dtype)[:s["tokens"]]
                           for s in manifest["shards"] if s["split"] == split])


def run_prepare(cfg, output, num_proc=2, shard_mb=0.004, task=None):
    return prepare(cfg, None, output, num_proc=num_proc, shard_mb=shard_mb, task=task, log=lambda *_: None,
                   stream=open(os.devnull, "w"))


@pytest.mark.parametrize("form", ["jsonl", "text", "parquet"])
def test_prepared_shards_hold_the_trainers_own_token_stream(form, tmp_path, tokenizer):
    """Several shards per file (byte ranges cut mid-line, Parquet row groups), two worker processes: the shards in
    manifest order are the token file the trainer writes from the same files, and each shard's index marks its
    documents' ends with an EOS."""
    docs = corpus_docs()[:120]
    if form == "jsonl":
        data = write_jsonl_dir(tmp_path / "data", docs)
    elif form == "text":
        data = tmp_path / "data.txt"
        data.write_text("\n".join(d.replace("\n", " ") for d in docs) + "\n\n", encoding="utf-8")
    else:
        import pyarrow
        import pyarrow.parquet

        data = tmp_path / "data.parquet"
        pyarrow.parquet.write_table(pyarrow.table({"text": docs}), data, row_group_size=10)
    cfg = DataConfig(dataset=str(data), data_cache_dir=str(tmp_path / "cache"))
    manifest = run_prepare(cfg, tmp_path / "prepared")
    shards = manifest["shards"]
    assert len(shards) > 3 and manifest["dtype"] == "uint16"
    np.testing.assert_array_equal(prepared_tokens(tmp_path / "prepared"), raw_tokens(tmp_path, cfg, tokenizer))
    assert manifest["tokens"]["train"] == sum(s["tokens"] for s in shards)
    first = shards[0]
    offsets = np.load(tmp_path / "prepared" / first["index"])
    tokens = np.fromfile(tmp_path / "prepared" / first["file"], dtype=np.uint16)
    assert offsets[-1] == len(tokens) == first["tokens"] and len(offsets) == first["documents"] + 1
    ends = [offsets[i + 1] - 1 for i in range(first["documents"]) if offsets[i + 1] > offsets[i]]
    assert (tokens[ends] == tokenizer.eos_token_id).all()


def test_max_documents_cuts_the_manifest_at_the_same_documents(tmp_path, tokenizer):
    """--max_documents 23 prepares the same tokens as the first 23 documents tokenized directly (~6 s: the preparation
    starts its tokenizing processes)."""
    docs = corpus_docs()[:80]
    data = write_jsonl_dir(tmp_path / "data", docs)
    cfg = DataConfig(dataset=str(data), data_cache_dir=str(tmp_path / "cache"), max_documents=23)
    manifest = run_prepare(cfg, tmp_path / "prepared", shard_mb=0.002)
    assert manifest["documents"]["train"] == 23
    np.testing.assert_array_equal(prepared_tokens(tmp_path / "prepared"), raw_tokens(tmp_path, cfg, tokenizer))


def test_slurm_tasks_take_turns_and_the_last_one_writes_the_manifest(tmp_path, tokenizer):
    data = write_jsonl_dir(tmp_path / "data", corpus_docs()[:60])
    cfg = DataConfig(dataset=str(data), data_cache_dir=str(tmp_path / "cache"))
    assert Task.from_environment({"SLURM_PROCID": "1", "SLURM_NTASKS": "2"}) == Task(1, 2)
    assert run_prepare(cfg, tmp_path / "prepared", num_proc=1, task=Task(1, 2)) is None  # task 0's shards missing
    done = sorted(p.name for p in (tmp_path / "prepared" / SHARDS_DIR).glob("*.done"))
    assert done and all(int(name[6:11]) % 2 == 1 for name in done)  # only odd shards: task 1's
    assert not (tmp_path / "prepared" / MANIFEST).exists()
    assert run_prepare(cfg, tmp_path / "prepared", num_proc=1, task=Task(0, 2)) is not None
    np.testing.assert_array_equal(prepared_tokens(tmp_path / "prepared"), raw_tokens(tmp_path, cfg, tokenizer))


def prepare_command(data: Path, output: Path, *extra) -> list[str]:
    return [sys.executable, "-m", "model_utils.prepare", "--dataset", str(data), "--output", str(output),
            "--shard_mb", "0.05", *extra]


def test_killed_preparation_resumes_without_redoing_finished_shards(tmp_path):
    """The command killed (its whole process group, -9) once a few shards are done; the rerun tokenizes only the
    others (the finished ones keep their files untouched) and the result equals an uninterrupted preparation's."""
    data = build_embedded_corpus()
    env = dict(os.environ, PYTHONPATH=str(SRC))
    killed = subprocess.Popen(prepare_command(data, tmp_path / "prepared", "--num_proc", "1"), cwd=REPO, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    shards = tmp_path / "prepared" / SHARDS_DIR
    deadline = time.monotonic() + 120
    while len(list(shards.glob("*.done"))) < 3 and killed.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    os.killpg(killed.pid, signal.SIGKILL)
    killed.wait()
    finished = {p.name: p.stat().st_mtime_ns for p in shards.glob("train-*") if not p.name.count(".tmp-")}
    done_before = len(list(shards.glob("*.done")))
    assert done_before >= 3 and not (tmp_path / "prepared" / MANIFEST).exists(), "killed too late to test a resume"

    rerun = subprocess.run(prepare_command(data, tmp_path / "prepared"), cwd=REPO, env=env, capture_output=True,
                           text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr
    total = json.loads((tmp_path / "prepared" / MANIFEST).read_text())["shards"]
    assert f"{done_before} already done, {len(total) - done_before} to tokenize" in rerun.stdout
    for name, mtime in finished.items():
        if name.endswith(".done"):
            stem = name[:-len(".done")]
            for suffix in (".done", ".bin", ".idx.npy"):
                assert (shards / f"{stem}{suffix}").stat().st_mtime_ns == finished[f"{stem}{suffix}"], stem

    whole = subprocess.run(prepare_command(data, tmp_path / "whole"), cwd=REPO, env=env, capture_output=True,
                           text=True, timeout=300)
    assert whole.returncode == 0, whole.stderr
    np.testing.assert_array_equal(prepared_tokens(tmp_path / "prepared"), prepared_tokens(tmp_path / "whole"))
    # Progress written to a log file: plain lines, never a carriage-return bar.
    assert "\r" not in whole.stderr and "tokens/s" in whole.stderr


def test_training_opens_prepared_data_as_the_raw_files(tmp_path, tokenizer):
    """--dataset DIR with a manifest: the same blocks, the same held-out validation and the same order as the raw
    files it came from (blocks span shard boundaries)."""
    data = write_jsonl_dir(tmp_path / "data", corpus_docs()[:100])
    raw_cfg = DataConfig(dataset=str(data), data_cache_dir=str(tmp_path / "cache"), validation_fraction=0.05)
    run_prepare(raw_cfg, tmp_path / "prepared")
    prepared_cfg = DataConfig(dataset=str(tmp_path / "prepared"), validation_fraction=0.05)
    assert resolve_source(prepared_cfg).kind == "prepared"
    raw = open_source(raw_cfg, resolve_source(raw_cfg), tokenizer, 64, OneProcess())
    prepared = open_source(prepared_cfg, resolve_source(prepared_cfg), tokenizer, 64, OneProcess())
    np.testing.assert_array_equal(raw.train_ids, prepared.train_ids)
    np.testing.assert_array_equal(raw.val_ids, prepared.val_ids)
    assert len(prepared.train.tokens.arrays) > 3  # several shards, read as one stream
    order = BlockOrder(prepared.train_ids, seed=3, world_size=2, micro_batch=2)
    for rank in (0, 1):
        picks = order.rank_indices(DataPosition(0, 4), rank)
        np.testing.assert_array_equal(raw.train.batch(picks), prepared.train.batch(picks))
    every = np.arange(prepared.train.num_blocks)
    np.testing.assert_array_equal(raw.train.batch(every), prepared.train.batch(every))


def test_a_prepared_directory_of_another_tokenizer_is_refused(tmp_path, tokenizer):
    data = write_jsonl_dir(tmp_path / "data", corpus_docs()[:20])
    run_prepare(DataConfig(dataset=str(data), data_cache_dir=str(tmp_path / "cache")), tmp_path / "prepared",
                num_proc=1)
    other = load_tokenizer(None)
    other.add_special_tokens({"additional_special_tokens": ["<|another|>"]})
    cfg = DataConfig(dataset=str(tmp_path / "prepared"))
    with pytest.raises(DataError) as caught:
        open_source(cfg, resolve_source(cfg), other, 64, OneProcess())
    problem = caught.value.problem
    assert problem.value == str(tmp_path / "prepared" / MANIFEST)
    assert "prepared with tokenizer default" in problem.message and "model_utils.prepare" in problem.fix


def test_pretokenized_input_ids_and_npy_token_files(tmp_path, tokenizer):
    """input_ids are taken as they are, an EOS added where a document lacks it; a .npy file is the stream itself;
    an id outside the vocabulary is a problem naming the file."""
    eos = tokenizer.eos_token_id
    rows = [[5, 6, 7], [8, 9, eos], [], [10]]
    (tmp_path / "ids").mkdir()
    (tmp_path / "ids" / "part.jsonl").write_text("".join(json.dumps({"input_ids": r}) + "\n" for r in rows * 40))
    cfg = DataConfig(dataset=str(tmp_path / "ids"), data_cache_dir=str(tmp_path / "cache"))
    expected = [5, 6, 7, eos, 8, 9, eos, 10, eos] * 40
    np.testing.assert_array_equal(raw_tokens(tmp_path, cfg, tokenizer), expected)
    manifest = run_prepare(cfg, tmp_path / "prepared", num_proc=1)
    assert manifest["tokens"]["train"] == len(expected)

    stream = np.arange(4000, dtype=np.int32) % len(tokenizer)
    np.save(tmp_path / "tokens.npy", stream)
    npy_cfg = DataConfig(dataset=str(tmp_path / "tokens.npy"), validation_fraction=0.0)
    data = open_source(npy_cfg, resolve_source(npy_cfg), tokenizer, 16, OneProcess())
    np.testing.assert_array_equal(data.train.block(3), stream[48:65])

    np.save(tmp_path / "bad.npy", np.array([1, 2, len(tokenizer)], dtype=np.int64))
    bad_cfg = DataConfig(dataset=str(tmp_path / "bad.npy"))
    with pytest.raises(DataError) as caught:
        open_source(bad_cfg, resolve_source(bad_cfg), tokenizer, 16, OneProcess())
    assert caught.value.problem.value == str(tmp_path / "bad.npy") and str(len(tokenizer)) in caught.value.problem.message


def test_a_bad_line_stops_the_preparation_with_its_line_and_a_failure_record(tmp_path):
    data = write_jsonl_dir(tmp_path / "data", corpus_docs()[:30])
    with open(data / "b.jsonl", "a") as f:
        f.write('{"text": "cut off\n')
    cfg = DataConfig(dataset=str(data), data_cache_dir=str(tmp_path / "cache"))
    with pytest.raises(DataError) as caught:
        run_prepare(cfg, tmp_path / "prepared", num_proc=1)
    lines = (data / "b.jsonl").read_text().count("\n")
    assert caught.value.problem.value == str(data / "b.jsonl") and f"line {lines}" in caught.value.problem.message
    recorded = json.loads((tmp_path / "prepared" / "FAILED.json").read_text())
    assert recorded["message"] == caught.value.problem.message


def test_prepare_data_sbatch_submits_the_command_and_needs_an_output(tmp_path):
    """A DRY_RUN prints the sbatch line; the script still looks for sbatch first, here a stand-in that is never run
    (this tier needs no SLURM: tests/slurm installs it)."""
    from launching import launch, stand_in_command

    path = stand_in_command(tmp_path / "bin", "sbatch", "echo 'stand-in sbatch: not for running' >&2\nexit 1\n")
    dry = launch("./prepare-data.sbatch", "--dataset", "corpus.jsonl", "--output", "/shared/prepared", DRY_RUN="1",
                 NODES="4", PATH=path)
    assert dry.returncode == 0, dry.stderr
    assert dry.stdout.strip().endswith("prepare-data.sbatch --dataset corpus.jsonl --output /shared/prepared")
    assert "+ sbatch --nodes=4 " in dry.stdout
    missing = launch("./prepare-data.sbatch", "--dataset", "corpus.jsonl", DRY_RUN="1", PATH=path)
    assert missing.returncode == 1 and "pass --output DIR" in missing.stderr and len(missing.stderr.splitlines()) == 1
