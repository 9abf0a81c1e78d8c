"""Real DeepSpeed runs on CPU: 2 gloo ranks, the tiny Qwen3 preset, the embedded corpus. Nothing is mocked."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys

import pytest
import torch
from conftest import FAST_ARGS, REPO, Trainer, assert_ok, kill_after_checkpoint_then_resume, run_trainer

from model_utils.checkpoint.protocol import find_resume_checkpoint, inspect_checkpoint, list_checkpoints

RESUME_ARGS = [*FAST_ARGS, "--max_steps", "10", "--checkpoint_freq", "5", "--no-export", "--seed", "11", "--trace_data"]


# configs/fp16.json resolves to fp32 where there is no GPU (fp16.enabled "auto"): on CPU its case would repeat
# ds_config.json's run step for step. fp16 itself (the loss scale, an overflow skipped and counted, an exact resume)
# runs on a GPU: benchmarks/fp16_check.py, in benchmarks/journey.sh's fp16 journey.
FP16_ON_CPU = pytest.mark.skip(reason="configs/fp16.json is fp32 on CPU, the same run as ds_config.json; fp16 runs on "
                                      "a GPU in benchmarks/fp16_check.py (journey.sh's fp16 journey)")


@pytest.mark.parametrize("config", [
    "ds_config.json", *(pytest.param(f"configs/{p.name}", marks=[FP16_ON_CPU] if p.name == "fp16.json" else [])
                        for p in sorted((REPO / "configs").glob("*.json")))])
def test_zero_stage_trains_checkpoints_and_exports(config, session_cache, tmp_path):
    run = run_trainer(tmp_path / "ckpt", [*FAST_ARGS, "--ds_config", config, "--max_steps", "4",
                                          "--checkpoint_freq", "2"])
    assert_ok(run)
    records = run.train_records()
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert all(math.isfinite(r["loss"]) and r["loss"] < 10.0 for r in records)
    info = inspect_checkpoint(tmp_path / "ckpt" / "step-00000004")
    assert info.complete, info.problem
    assert info.manifest["world_size"] == 2
    stage = json.loads((REPO / config).read_text())["zero_optimization"]["stage"]
    assert info.manifest["zero_stage"] == stage
    assert (tmp_path / "ckpt" / "latest").read_text() == "step-00000004"
    assert (tmp_path / "ckpt" / "hf" / "model.safetensors").stat().st_size > 1_000_000  # never an empty export

    # The standalone export of the same checkpoint, on CPU, equals the end-of-run export.
    from transformers import AutoModelForCausalLM

    from model_utils.models.export import export_checkpoint

    exported = export_checkpoint(tmp_path / "ckpt", tmp_path / "exported", dtype="float32", log=lambda *_: None)
    ours = AutoModelForCausalLM.from_pretrained(exported).state_dict()
    final = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt" / "hf").state_dict()
    assert ours.keys() == final.keys()
    for key in ours:
        assert torch.equal(ours[key], final[key]), key


@pytest.fixture(scope="module")
def trained(session_cache, tmp_path_factory):
    """A 40-step run with evaluation: the loss must fall and the export must work."""
    ckpt = tmp_path_factory.mktemp("trained") / "ckpt"
    run = run_trainer(ckpt, ["--seq_len", "128", "--micro_batch_size", "4", "--max_steps", "40", "--log_interval", "5",
                             "--eval_interval", "20", "--eval_iters", "4", "--checkpoint_freq", "10",
                             "--keep_last_checkpoints", "2", "--generate_prompt", "Return the"],
                      env={"OMP_NUM_THREADS": None})  # unset, as the launchers leave it: the ranks share the cores
    assert_ok(run)
    return run


def test_ranks_on_one_node_share_its_cores(trained, baseline):
    """Two ranks on this machine without CPU masks of their own, OMP_NUM_THREADS unset: each runs torch's threads for
    the machine divided by two (a mask narrower than the machine keeps torch's count, sized to it); with
    OMP_NUM_THREADS=1 (the baseline's) that is what they run."""
    default = int(subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
                                 env={k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"},
                                 capture_output=True, text=True, check=True).stdout)
    if len(os.sched_getaffinity(0)) == os.cpu_count():
        expected = f"host threads: {max(1, default // 2)} per rank (torch's {default} for this node's cores, shared"
    else:
        expected = f"host threads: {default} per rank (torch's default of this rank's"
    assert expected in trained.output, trained.output[:3000]
    assert "host threads: 1 per rank (OMP_NUM_THREADS=1)" in baseline.output


def test_loss_falls_and_metrics_are_complete(trained):
    records = trained.train_records()
    assert [r["step"] for r in records] == [5, 10, 15, 20, 25, 30, 35, 40]
    for r in records:
        assert {"step", "loss", "lr", "grad_norm", "tokens_per_s", "tokens_seen"} <= r.keys()
        assert r["tokens_per_s"] > 0
    assert records[-1]["loss"] < records[0]["loss"] - 1.0
    evals = [r for r in trained.metrics() if "eval_loss" in r]
    assert [r["step"] for r in evals] == [20, 40]
    assert evals[-1]["eval_ppl"] == pytest.approx(math.exp(evals[-1]["eval_loss"]))
    assert "world size" in trained.output or "world 2" in trained.output
    # A log that is not a terminal gets the log lines, not progress bars' redraws (the trainer's, transformers').
    assert "\r" not in trained.output and "it/s" not in trained.output


def test_retention_keeps_the_last_k_complete_checkpoints(trained):
    kept = [c.path.name for c in list_checkpoints(trained.checkpoint_dir)]
    assert kept == ["step-00000040", "step-00000030"]


def test_export_loads_with_from_pretrained_and_generates(trained):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = trained.checkpoint_dir / "hf"
    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    ids = tokenizer("Return the number of items in the container.", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss.item()
        generated = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert loss < math.log(len(tokenizer))  # better than uniform: the weights are the trained ones
    assert generated.shape[1] == ids.shape[1] + 8
    assert "sample: Return the" in trained.output


def _reference_run(tmp_path_factory, name, args, nproc=2):
    """An uninterrupted run, for a module's tests to compare theirs with."""
    run = run_trainer(tmp_path_factory.mktemp(name) / "ckpt", args, nproc=nproc)
    assert_ok(run)
    return run


@pytest.fixture(scope="module")
def baseline(session_cache, tmp_path_factory):
    return _reference_run(tmp_path_factory, "baseline", RESUME_ARGS)


def test_two_fresh_runs_are_bitwise_equal(baseline, tmp_path):
    again = run_trainer(tmp_path / "ckpt", RESUME_ARGS)
    assert_ok(again)
    assert [(r["loss"], r["lr"]) for r in again.train_records()] == [(r["loss"], r["lr"]) for r in baseline.train_records()]


def test_document_mask_trains_with_attention_within_documents(baseline, tmp_path):
    """The baseline's run with --document_mask: the same blocks in the same order, and different losses (about one
    block in twelve of 64 tokens holds a document's end, where attention now stops)."""
    run = run_trainer(tmp_path / "ckpt", [*RESUME_ARGS, "--document_mask"])
    assert_ok(run)
    assert "attention: within documents" in run.output
    masked, plain = [r["loss"] for r in run.train_records()], [r["loss"] for r in baseline.train_records()]
    assert len(masked) == len(plain) == 10 and all(math.isfinite(x) for x in masked)
    assert masked != plain
    assert _blocks_by_rank(tmp_path / "ckpt") == _blocks_by_rank(baseline.checkpoint_dir)
    # FLOPs (and MFU) count each document's attention square: fewer per token where a block holds a document's end.
    per_token = [[r["tflops_per_device"] / r["tokens_per_s_per_device"] for r in records]
                 for records in (run.train_records(), baseline.train_records())]
    masked_flops, plain_flops = per_token
    assert max(plain_flops) == pytest.approx(min(plain_flops), rel=1e-9)  # every block's square is T x T
    assert all(m <= plain_flops[0] * (1 + 1e-9) for m in masked_flops)
    assert min(masked_flops) < plain_flops[0] * (1 - 1e-3)


def _assert_continues_exactly(baseline, resumed, from_step):
    want, got = baseline.train_records_by_step(), resumed.train_records_by_step()
    assert from_step < 10
    for step in range(from_step + 1, 11):
        assert (got[step]["loss"], got[step]["lr"]) == (want[step]["loss"], want[step]["lr"]), f"step {step}"


def _blocks_by_rank(ckpt):
    """Each rank's blocks, one entry per step; a step redone after a crash counts once (its last record)."""
    seen = {}
    for trace in sorted((ckpt / "data_trace").glob("rank-*.jsonl")):
        by_step = {r["step"]: r["blocks"] for r in map(json.loads, trace.read_text().splitlines())}
        seen[trace.name] = sorted(b for step in sorted(by_step) for b in by_step[step])
    return seen


def test_resume_after_kill_9_is_exact(baseline, tmp_path):
    ckpt = tmp_path / "ckpt"
    resumed = kill_after_checkpoint_then_resume(ckpt, RESUME_ARGS, 5)
    _assert_continues_exactly(baseline, resumed, 5)
    # Data position: each rank saw exactly the blocks (as a multiset) it sees in the uninterrupted run.
    want = _blocks_by_rank(baseline.checkpoint_dir)
    assert set(want) == {"rank-00000.jsonl", "rank-00001.jsonl"} and len(want["rank-00000.jsonl"]) == 10 * 2
    assert _blocks_by_rank(ckpt) == want
    assert not set(want["rank-00000.jsonl"]) & set(want["rank-00001.jsonl"])  # ranks never share a block


# Dropout draws on torch's RNG at every training step: a resume that did not restore each rank's RNG state would draw
# other masks and its losses would part from the uninterrupted run's at the first step after the checkpoint. (Without
# dropout nothing in a step is random: the data order comes from generators seeded by (seed, epoch).)
DROPOUT_ARGS = [*RESUME_ARGS, "--attention_dropout", "0.2"]


@pytest.fixture(scope="module")
def dropout_baseline(session_cache, tmp_path_factory):
    return _reference_run(tmp_path_factory, "dropout-baseline", DROPOUT_ARGS)


def test_dropout_draws_on_the_rng_in_training(dropout_baseline, baseline):
    """The same run with dropout: other losses from the first step on (the weights and data are the same)."""
    dropped, plain = dropout_baseline.train_records_by_step(), baseline.train_records_by_step()
    assert sorted(dropped) == sorted(plain) == list(range(1, 11))
    assert all(dropped[step]["loss"] != plain[step]["loss"] for step in dropped)


def test_resume_after_kill_9_restores_every_ranks_rng(dropout_baseline, tmp_path):
    """kill -9 after step 5's checkpoint, then the same command: with dropout in training, the losses of steps 6-10
    equal the uninterrupted run's bit for bit only where every rank's RNG state came back from the checkpoint."""
    resumed = kill_after_checkpoint_then_resume(tmp_path / "ckpt", DROPOUT_ARGS, 5)
    _assert_continues_exactly(dropout_baseline, resumed, 5)


def test_resume_from_a_named_checkpoint_that_is_not_the_latest(dropout_baseline, tmp_path):
    """--resume_from_checkpoint names step 5 of a directory whose `latest` is step 10; the run, in a directory of its
    own, continues from step 5 exactly as the uninterrupted run did (dropout: its RNG state too)."""
    source = _copy_tree(dropout_baseline.checkpoint_dir, tmp_path / "source")
    assert (source / "latest").read_text() == "step-00000010"
    run = run_trainer(tmp_path / "ckpt", [*DROPOUT_ARGS, "--resume_from_checkpoint", str(source / "step-00000005")])
    assert_ok(run)
    assert f"resume: continuing from {source / 'step-00000005'} at step 5" in run.output
    assert sorted(run.train_records_by_step()) == list(range(6, 11))  # nothing before step 5 was redone
    _assert_continues_exactly(dropout_baseline, run, 5)


def test_signal_to_one_rank_saves_exits_75_and_resume_is_exact(baseline, tmp_path):
    ckpt = tmp_path / "ckpt"
    first = Trainer(ckpt, RESUME_ARGS)
    metrics = ckpt / "metrics.jsonl"
    assert first.wait_for(lambda: metrics.exists() and '"step": 2' in metrics.read_text())
    first.procs[1].send_signal(signal.SIGUSR1)  # only rank 1: the ranks must agree to stop together
    stopped = first.wait()
    assert stopped.returncodes == [75, 75], stopped.outputs
    stop_step = int(json.loads((ckpt / find_resume_checkpoint(ckpt, print).path.name / "manifest.json").read_text())["step"])
    assert 2 <= stop_step < 10
    resumed = run_trainer(ckpt, RESUME_ARGS)
    assert_ok(resumed)
    _assert_continues_exactly(baseline, resumed, stop_step)


def _copy_tree(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_corrupt_checkpoints_fall_back_or_are_moved_aside_with_the_file_named(baseline, tmp_path):
    ckpt = _copy_tree(baseline.checkpoint_dir, tmp_path / "ckpt")
    warnings = []
    # A truncated shard in the newest checkpoint: fall back to the previous one, with a warning naming the file.
    shard = next(p for p in (ckpt / "step-00000010").iterdir() if "optim_states" in p.name)
    shard.write_bytes(shard.read_bytes()[:100])
    assert find_resume_checkpoint(ckpt, warnings.append).path.name == "step-00000005"
    assert shard.name in warnings[0] and "truncated" in warnings[0]
    # An empty `latest`, and one naming a missing directory: warned about, not trusted.
    for content, words in (("", "is empty"), ("step-00000099", "does not exist")):
        (ckpt / "latest").write_text(content)
        warnings.clear()
        assert find_resume_checkpoint(ckpt, warnings.append).path.name == "step-00000005"
        assert words in warnings[0]
    # No complete checkpoint left: both are moved aside, each named with why, and the run starts from step 0, saying
    # so; what was there is kept in incomplete/.
    (ckpt / "step-00000005" / "manifest.json").unlink()
    run = run_trainer(ckpt, RESUME_ARGS)
    assert_ok(run)
    moved = [line for line in run.output.splitlines() if "incomplete checkpoint moved aside" in line]
    assert ("warning: checkpoint: incomplete checkpoint moved aside: step-00000010 -> incomplete/step-00000010 ("
            in moved[0]) and shard.name in moved[0] and "truncated" in moved[0]
    assert ("warning: checkpoint: incomplete checkpoint moved aside: step-00000005 -> incomplete/step-00000005 ("
            in moved[1]) and "manifest.json is missing" in moved[1]
    assert "this run STARTS FROM STEP 0" in run.output and "resume: continuing from" not in run.output
    assert (ckpt / "incomplete" / "step-00000010" / shard.name).stat().st_size == 100
    assert [r["step"] for r in run.train_records()][-10:] == list(range(1, 11))
    assert inspect_checkpoint(ckpt / "step-00000010").complete


# Resuming on another number of ranks, against an uninterrupted run of the same global batch (4 blocks a step: 2 ranks
# x micro-batch 2, or 1 rank x micro-batch 4). The sums behind a step's loss and gradients then run in another order
# (one rank's mean over 4 blocks against two ranks' means over 2, all-reduced), which in fp32 moves a result by a unit
# or two in its last place: measured over steps 6-10, the losses differ by 1.6e-7 relative at most, Adam's moments
# at step 10 by 2.3e-7 (norm of the difference over the reference's norm). The tolerances stand 60 and 400 times
# above that, and far below what a resume that lost something gives: Adam's moments zeroed at the resume change
# step 7's loss by 1.2e-3 relative; the data position lost changes the blocks read; the moments of steps 1-5 carry
# about 0.9^5 of exp_avg at step 10.
LOSS_TOLERANCE = 1e-5
MOMENT_TOLERANCE = 1e-4


def _with_micro_batch(args, micro):
    at = args.index("--micro_batch_size")
    return [*args[:at + 1], str(micro), *args[at + 2:]]


def _blocks_by_step(ckpt):
    """The blocks of every step over all ranks, in the global batch's order (rank 0's, then rank 1's)."""
    by_step = {}
    for trace in sorted((ckpt / "data_trace").glob("rank-*.jsonl")):
        for step, blocks in {r["step"]: r["blocks"] for r in map(json.loads, trace.read_text().splitlines())}.items():
            by_step.setdefault(step, []).extend(blocks)
    return by_step


def _adam_moments(step_dir):
    """Adam's exp_avg and exp_avg_sq of every parameter group, over the whole model: ZeRO-1/2 keeps each group as one
    flat tensor split across the ranks in rank order, the last partition padded."""
    moments = {}
    for shard in sorted(step_dir.glob("zero_pp_rank_*_mp_rank_00_optim_states.pt"),
                        key=lambda p: int(p.name.split("_")[3])):
        state = torch.load(shard, weights_only=False, map_location="cpu")["optimizer_state_dict"]
        for group, group_state in state["base_optimizer_state"]["state"].items():
            keep = len(group_state["exp_avg"]) - state["group_paddings"][group]
            for name in ("exp_avg", "exp_avg_sq"):
                moments.setdefault((group, name), []).append(group_state[name][:keep])
    return {key: torch.cat(parts) for key, parts in moments.items()}


def _assert_resumed_on_another_world_size(reference, resumed, from_step, to_step=10):
    want, got = reference.train_records_by_step(), resumed.train_records_by_step()
    assert sorted(got) == list(range(from_step + 1, to_step + 1))
    for step in got:
        assert got[step]["lr"] == want[step]["lr"], f"step {step}: the schedule continues exactly"
        assert got[step]["loss"] == pytest.approx(want[step]["loss"], rel=LOSS_TOLERANCE), f"step {step}"
    want_blocks, got_blocks = _blocks_by_step(reference.checkpoint_dir), _blocks_by_step(resumed.checkpoint_dir)
    assert {s: got_blocks[s] for s in got} == {s: want_blocks[s] for s in got}  # the same data, in the same order
    tag = f"step-{to_step:08d}"
    want_moments = _adam_moments(reference.checkpoint_dir / tag)
    got_moments = _adam_moments(resumed.checkpoint_dir / tag)
    assert want_moments.keys() == got_moments.keys() and len(want_moments) == 4
    for key, moment in want_moments.items():
        assert got_moments[key].shape == moment.shape, key
        assert (got_moments[key] - moment).norm() <= MOMENT_TOLERANCE * moment.norm(), key


@pytest.fixture(scope="module")
def one_rank_baseline(session_cache, tmp_path_factory):
    """The baseline's run on 1 rank at the same global batch (micro-batch 4)."""
    return _reference_run(tmp_path_factory, "one-rank", _with_micro_batch(RESUME_ARGS, 4), nproc=1)


def test_two_ranks_resume_on_one_through_a_universal_checkpoint(baseline, tmp_path):
    """2 ranks saved step 5 (and 10); 1 rank resumes from step 5 (converted with ds_to_universal) and trains to 10:
    the same learning rates, the same blocks, Adam's moments carried over, the losses to LOSS_TOLERANCE."""
    source = _copy_tree(baseline.checkpoint_dir, tmp_path / "source")
    args = [*_with_micro_batch(RESUME_ARGS, 4), "--resume_from_checkpoint", str(source / "step-00000005")]
    run = run_trainer(tmp_path / "ckpt", args, nproc=1)
    assert_ok(run)
    assert "saved by 2 ranks, this run has 1; converting it to a universal checkpoint" in run.output
    assert "deepspeed.checkpoint.ds_to_universal --input_folder" in run.output
    assert "resume: continuing from" in run.output and "at step 5" in run.output
    assert (source / "step-00000005-universal" / "converted").exists()
    assert inspect_checkpoint(tmp_path / "ckpt" / "step-00000010").manifest["world_size"] == 1
    _assert_resumed_on_another_world_size(baseline, run, 5)


def test_one_rank_resumes_on_two_through_a_universal_checkpoint(one_rank_baseline, tmp_path):
    """The other way: 1 rank saved step 5; 2 ranks (micro-batch 2 each) resume from it to step 10."""
    source = _copy_tree(one_rank_baseline.checkpoint_dir, tmp_path / "source")
    run = run_trainer(tmp_path / "ckpt", [*RESUME_ARGS, "--resume_from_checkpoint", str(source / "step-00000005")])
    assert_ok(run)
    assert "saved by 1 ranks, this run has 2; converting it to a universal checkpoint" in run.output
    assert inspect_checkpoint(tmp_path / "ckpt" / "step-00000010").manifest["world_size"] == 2
    _assert_resumed_on_another_world_size(one_rank_baseline, run, 5)


def test_a_failed_universal_conversion_stops_with_the_command_to_run_by_hand(baseline, tmp_path):
    """The conversion of a checkpoint saved by another number of ranks fails (here its output folder is taken by a
    file): the run stops with status 2, the reason and the command, no traceback, and the checkpoint untouched."""
    ckpt = _copy_tree(baseline.checkpoint_dir, tmp_path / "ckpt")
    (ckpt / "step-00000010-universal").write_text("in the way")
    before = sorted(os.listdir(ckpt))
    run = run_trainer(ckpt, [a if a != "10" else "14" for a in RESUME_ARGS], nproc=1)
    assert run.returncode == 2, run.output[-3000:]
    assert "converting it failed" in run.output and "Run it by hand:" in run.output, run.output[-3000:]
    assert "Traceback" not in run.output
    assert sorted(os.listdir(ckpt)) == before


def test_resume_never_refuses_to_overwrite_existing_checkpoints(baseline, tmp_path):
    """Two ranks: only rank 0 reads the checkpoints, and both stop on what it found, reported once."""
    ckpt = _copy_tree(baseline.checkpoint_dir, tmp_path / "ckpt")
    before = sorted(os.listdir(ckpt))
    run = run_trainer(ckpt, [*RESUME_ARGS, "--resume", "never"], nproc=2)
    assert run.returncodes == [2, 2] and run.output.count("already holds checkpoints") == 1, run.output[-3000:]
    assert sorted(os.listdir(ckpt)) == before


def test_bad_arguments_exit_2_before_any_work(tmp_path):
    run = run_trainer(tmp_path / "ckpt", ["--max_steps", "0", "--ds_config", "nope.json"], nproc=1)
    assert run.returncode == 2
    assert "--max_steps" in run.output and "--ds_config" in run.output and "fix:" in run.output
    assert "Traceback" not in run.output


def test_nonfinite_loss_stops_and_keeps_the_last_good_checkpoint(session_cache, tmp_path):
    """A learning rate of 1e30 blows the weights up within a few steps. DeepSpeed's ZeRO step skips the non-finite
    update (its norm check covers fp32 too); with --max_bad_steps 1 the run stops there with status 3, saving
    nothing: `latest` stays the step before."""
    ckpt = tmp_path / "ckpt"
    run = run_trainer(ckpt, [*FAST_ARGS, "--max_steps", "6", "--checkpoint_freq", "1", "--learning_rate", "1e30",
                             "--warmup_steps", "1", "--no-export", "--max_bad_steps", "1"])
    import re

    assert run.returncode == 3, run.output
    assert "the last saved one is intact" in run.output
    bad_step = int(re.search(r"step (\d+): non-finite loss or gradient norm", run.output).group(1))
    assert 2 <= bad_step <= 6
    assert (ckpt / "latest").read_text() == f"step-{bad_step - 1:08d}"  # every step before it was saved (freq 1)
    assert not (ckpt / f"step-{bad_step:08d}").exists()


def test_skipped_steps_are_not_saved_and_the_run_goes_on(session_cache, tmp_path):
    """Skipped updates fewer than --max_bad_steps in a row do not stop the run, and the periodic save that falls on
    one waits for the next good step (the checkpoint of a skipped step would resume into the same trouble). The
    blow-up above gives bad steps from step 3 on (step 2 is the first at the huge rate): every checkpoint written is
    of a step whose update applied."""
    ckpt = tmp_path / "ckpt"
    run = run_trainer(ckpt, [*FAST_ARGS, "--max_steps", "6", "--checkpoint_freq", "1", "--learning_rate", "1e30",
                             "--warmup_steps", "1", "--no-export", "--keep_last_checkpoints", "0",
                             "--max_bad_steps", "5"])
    import re

    bad = sorted({int(s) for s in re.findall(r"step (\d+): non-finite loss or gradient norm", run.output)})
    assert bad and "DeepSpeed skipped this update" in run.output
    saved = sorted(int(p.name.split("-")[1]) for p in ckpt.glob("step-*"))
    assert not (set(saved) - {6}) & set(bad), (saved, bad)  # the end of the run saves whatever its last step was
    assert all(f"checkpoint: not saved at step {s}" in run.output for s in bad if s < 6)


EPOCH_ARGS = [*FAST_ARGS, "--dummy_data", "40", "--max_steps", "14", "--no-export", "--seed", "3"]


def test_resume_at_an_epoch_boundary_is_exact(session_cache, tmp_path):
    """40 dummy blocks, 4 held out: 36 train blocks / (2 ranks x 2) = 9 steps per epoch; stop after step 9."""
    full = run_trainer(tmp_path / "full", [*EPOCH_ARGS, "--checkpoint_freq", "0"])
    assert_ok(full)
    ckpt = tmp_path / "ckpt"
    first = Trainer(ckpt, [*EPOCH_ARGS, "--checkpoint_freq", "9"])
    assert first.wait_for(lambda: (ckpt / "step-00000009" / "manifest.json").exists())
    for p in first.procs:
        p.send_signal(signal.SIGKILL)
    first.wait()
    manifest = json.loads((ckpt / "step-00000009" / "manifest.json").read_text())
    assert manifest["data_position"] == {"epoch": 1, "blocks_consumed": 0}  # exactly at the boundary
    resumed = run_trainer(ckpt, [*EPOCH_ARGS, "--checkpoint_freq", "9"])
    assert_ok(resumed)
    want, got = full.train_records_by_step(), resumed.train_records_by_step()
    for step in range(10, 15):
        assert (got[step]["loss"], got[step]["lr"]) == (want[step]["loss"], want[step]["lr"]), f"step {step}"


def test_checkpoints_by_the_clock_and_their_stall_is_recorded(session_cache, tmp_path):
    """--checkpoint_minutes with a threshold shorter than any step saves after every step (rank 0's clock decides for
    both ranks, which must agree or the save's barriers would hang); each save's stall is a metrics record and the
    summary counts them. --checkpoint_freq 0: no save by step count."""
    ckpt = tmp_path / "ckpt"
    run = run_trainer(ckpt, [*FAST_ARGS, "--max_steps", "4", "--checkpoint_freq", "0", "--checkpoint_minutes", "0.0001",
                             "--keep_last_checkpoints", "0", "--no-export"])
    assert_ok(run)
    assert sorted(p.name for p in ckpt.glob("step-*")) == [f"step-{s:08d}" for s in (1, 2, 3, 4)]
    stalls = [r for r in run.metrics() if "checkpoint_s" in r]
    assert [r["step"] for r in stalls] == [1, 2, 3, 4] and all(r["checkpoint_s"] > 0 for r in stalls)
    summary = json.loads((ckpt / "summary.json").read_text())
    assert summary["checkpoint_saves"] == 4 and summary["checkpoint_s_max"] >= summary["checkpoint_s_mean"] > 0
