"""The launchers on a real SLURM cluster: slurmctld and two slurmd on this host emulating node1 and node2
(tests/slurm_fixtures.py). Training runs on CPU: one task per node, gloo.

Pyxis and Enroot do not exist on this cluster: the container launchers are tested through DRY_RUN only (the
composed srun line, printed by a real batch job); that is the only thing these tests fake."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
from launching import stand_in_nvidia_smi
from slurm_fixtures import REPO_ROOT

# A few fast steps of the tiny default model on the embedded corpus.
FAST_ENV = {"MAX_STEPS": "6", "CHECKPOINT_FREQ": "3", "SEQ_LEN": "64"}
FAST_ARGS = ["--micro_batch_size", "2", "--log_interval", "1", "--eval_interval", "0", "--eval_iters", "2"]
LOSS_LINE = re.compile(r"step (\d+) \| loss (\d+\.\d+)")


def submitted_job(result) -> int:
    match = re.search(r"Submitted batch job (\d+)", result.stdout)
    assert match, f"no job submitted:\n{result.stdout}\n{result.stderr}"
    return int(match.group(1))


def job_log(job_id: int, name: str = "ds-train") -> Path:
    return REPO_ROOT / "logs" / f"{name}_{job_id}.out"


def wait_for_text(path: Path, pattern: re.Pattern, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = path.read_text(errors="replace") if path.exists() else ""
        if pattern.search(text):
            return text
        time.sleep(1)
    raise AssertionError(f"{pattern.pattern!r} not in {path} after {timeout}s:\n{text[-3000:]}")


def python_with_fault(tmp_path: Path, fault: str) -> dict:
    """The launcher's PYTHON for a job whose first start (SLURM_RESTART_COUNT 0 or unset) runs the trainer through
    tests/distributed/fault_injection.py with FAULT=`fault`: a fault at an exact point of a save, not a timing. A
    requeued start, and every other use of PYTHON by the launcher, runs the plain interpreter."""
    wrapper = tmp_path / "python-with-fault"
    inject = REPO_ROOT / "tests" / "distributed" / "fault_injection.py"
    wrapper.write_text("#!/bin/bash\n"
                       'if [[ $1 == src/train_deepspeed.py && ${SLURM_RESTART_COUNT:-0} == 0 ]]; then\n'
                       f'    shift; exec python3 {inject} "$@"\n'
                       "fi\n"
                       'exec python3 "$@"\n')
    wrapper.chmod(0o755)
    return {"PYTHON": str(wrapper), "FAULT": fault}


def fake_image(tmp_path: Path) -> Path:
    """Stands in for the .sqsh that setup-pyxis.sh builds (Enroot is not installed here)."""
    image = tmp_path / "trainer.sqsh"
    image.write_bytes(b"hsqs")
    return image


def test_sbatch_trains_on_two_nodes(slurm, tmp_path):
    """`train.sbatch` across node1 and node2: a real job (~35 s: its scheduling, two ranks' imports and a short run)."""
    ckpt = tmp_path / "ckpt"
    result = slurm.run("./train.sbatch", *FAST_ARGS, env={**FAST_ENV, "CHECKPOINT_DIR": str(ckpt)})
    assert result.returncode == 0, result.stderr
    job_id = submitted_job(result)
    info = slurm.wait_job(job_id, timeout=240)
    log = job_log(job_id)
    text = log.read_text(errors="replace")
    assert info["JobState"] == "COMPLETED", text[-4000:]
    # One rank on each node, a world of two.
    assert f"job {job_id} on node[1-2]; world size 2 (0 GPUs per node); restart count 0" in text
    assert sorted(re.findall(r"task: rank (\d)/2 on (node\d)", text)) == [("0", "node1"), ("1", "node2")]
    assert "MASTER_ADDR=node1" in text
    assert "x world 2 " in text
    losses = [float(loss) for _, loss in LOSS_LINE.findall(text)]
    assert losses and all(0 < loss < 20 for loss in losses), text[-3000:]
    assert (ckpt / "step-00000006").is_dir() and (ckpt / "latest").exists()
    assert (ckpt / "metrics.jsonl").stat().st_size > 0
    # A job that finished is not requeued.
    assert info["Restarts"] == "0" and "requeue" not in text
    log.unlink()


def test_the_seeds_sbatch_on_a_gpu_node_given_no_gpus_stops_before_training(slurm, tmp_path):
    """`sbatch train.sbatch`, as the seeds write it. nvidia-smi is a stand-in listing two GPUs (there is no GPU here) on
    a cluster that manages GPUs (GresTypes=gpu) but gave this job none: the job stops in one line naming the fix and
    never starts the trainer. The script's request is --exclusive (all of a node's GRES where SLURM has them)."""
    ckpt = tmp_path / "ckpt"
    env = {**FAST_ENV, "CHECKPOINT_DIR": str(ckpt), "PATH": stand_in_nvidia_smi(tmp_path / "bin", 2)}
    job_id = submitted_job(slurm.run("sbatch", "train.sbatch", *FAST_ARGS, env=env))
    info = slurm.wait_job(job_id, timeout=120)
    log = job_log(job_id)
    text = log.read_text(errors="replace")
    assert info["JobState"] == "FAILED" and info["OverSubscribe"] == "NO", text[-3000:]  # exclusive: the request
    assert f"job {job_id} was given no GPUs, but node node1 has 2: it would train on CPU" in text
    assert "sbatch --gpus-per-node=N train.sbatch" in text and "#SBATCH --gpus-per-node" in text
    assert "task: rank" not in text and not ckpt.exists()
    log.unlink()


def test_preempted_job_checkpoints_requeues_and_resumes(slurm, tmp_path):
    """USR1 to the batch shell (what --signal=B:USR1@300 does before the time limit): the trainer saves and exits 75,
    the job requeues itself, and the second run resumes from that checkpoint and finishes."""
    ckpt = tmp_path / "ckpt"
    env = {**FAST_ENV, "MAX_STEPS": "60", "CHECKPOINT_FREQ": "0", "CHECKPOINT_DIR": str(ckpt)}
    job_id = submitted_job(slurm.run("./train.sbatch", *FAST_ARGS, env=env))
    log = job_log(job_id)
    wait_for_text(log, LOSS_LINE, timeout=180)
    assert slurm.run("scancel", "--signal=USR1", "--batch", str(job_id)).returncode == 0
    text = wait_for_text(log, re.compile(f"requeueing job {job_id}"), timeout=120)
    assert "USR1: forwarding to the training step" in text
    saved = int(re.search(r"stop: SIGUSR1 received; checkpoint saved at step (\d+)", text).group(1))
    assert 0 < saved < 60 and (ckpt / f"step-{saved:08d}").is_dir()
    assert "training step finished with status 75" in text
    # The requeued job waits (Reason=BeginTime) as long as a job credential lives: AuthInfo=cred_expire, shortened
    # to 10 s on the test cluster (SLURM's default: 120 s).
    info = slurm.wait_job(job_id, timeout=240)
    text = log.read_text(errors="replace")
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", text[-4000:]
    assert "restart count 0" in text and "restart count 1" in text
    assert re.search(rf"resume: continuing from \S*step-{saved:08d}", text), text[-3000:]
    assert text.count("requeueing job") == 1 and "training step finished with status 0" in text
    assert (ckpt / "step-00000060").is_dir()
    log.unlink()


def test_scancel_during_saves_leaves_a_resumable_state(slurm, tmp_path):
    """A job saving every step is cancelled while its save of step 3 is incomplete: rank 1 has written its files and
    stops there (fault point pause-before-manifest), so step 3 never gets a manifest. The next submission moves step 3
    aside, resumes from step 2 and finishes."""
    from model_utils.checkpoint.protocol import inspect_checkpoint

    ckpt = tmp_path / "ckpt"
    env = {**FAST_ENV, "MAX_STEPS": "8", "CHECKPOINT_FREQ": "1", "CHECKPOINT_DIR": str(ckpt)}
    args = [*FAST_ARGS, "--keep_last_checkpoints", "0", "--no-export"]
    first = submitted_job(slurm.run("./train.sbatch", *args,
                                    env={**env, **python_with_fault(tmp_path, "pause-before-manifest:1:3")}))
    paused = ckpt / "step-00000003" / "rng_state_rank00001.pt"
    deadline = time.monotonic() + 180
    while not paused.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert paused.exists(), job_log(first).read_text(errors="replace")[-3000:]
    assert slurm.run("scancel", str(first)).returncode == 0
    info = slurm.wait_job(first, timeout=120)
    assert info["JobState"] == "CANCELLED"
    slurm.wait_nodes_idle(timeout=180)  # the tasks are killed after KillWait: rank 1's save never finishes
    first_log = job_log(first).read_text(errors="replace")
    assert "not requeueing" in first_log or "training step finished" not in first_log, first_log[-3000:]
    assert slurm.job(first).get("Restarts") == "0" and slurm.job(first).get("JobState") == "CANCELLED"  # stays cancelled
    assert inspect_checkpoint(ckpt / "step-00000002").complete
    assert not inspect_checkpoint(ckpt / "step-00000003").complete
    assert (ckpt / "latest").read_text() == "step-00000002"

    second = submitted_job(slurm.run("./train.sbatch", *args, env=env))
    info = slurm.wait_job(second, timeout=300)
    text = job_log(second).read_text(errors="replace")
    assert info["JobState"] == "COMPLETED", text[-4000:]
    assert "incomplete checkpoint moved aside: step-00000003 -> incomplete/step-00000003 (" in text, text[-3000:]
    assert re.search(r"resume: continuing from \S*step-00000002", text), text[-3000:]
    assert (ckpt / "incomplete" / "step-00000003" / "rng_state_rank00001.pt").exists()
    assert inspect_checkpoint(ckpt / "step-00000008").complete
    job_log(first).unlink(missing_ok=True)
    job_log(second).unlink()


def test_requeue_after_a_kill_in_the_first_save_starts_fresh_and_completes(slurm, tmp_path):
    """Rank 1 is killed (-9) in the job's first save (step 3, its files written, no manifest), as a node failure
    would: the job fails. It is requeued as SLURM requeues a job after a node failure (`scontrol requeue`, the test's
    stand-in for the failure itself); the requeued start moves step 3 aside, finds no complete checkpoint, says it
    starts from step 0, and completes."""
    from model_utils.checkpoint.protocol import inspect_checkpoint

    ckpt = tmp_path / "ckpt"
    env = {**FAST_ENV, "CHECKPOINT_DIR": str(ckpt), **python_with_fault(tmp_path, "kill-before-manifest:1:3")}
    job_id = submitted_job(slurm.run("./train.sbatch", *FAST_ARGS, env=env))
    info = slurm.wait_job(job_id, timeout=240)
    log = job_log(job_id)
    text = log.read_text(errors="replace")
    assert info["JobState"] == "FAILED" and info["Restarts"] == "0", text[-3000:]
    assert (ckpt / "step-00000003").is_dir() and not (ckpt / "latest").exists()
    slurm.wait_nodes_idle(timeout=120)
    assert slurm.run("scontrol", "requeue", str(job_id)).returncode == 0
    info = slurm.wait_job(job_id, timeout=300)
    text = log.read_text(errors="replace")
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", text[-4000:]
    assert "restart count 1" in text
    assert "incomplete checkpoint moved aside: step-00000003 -> incomplete/step-00000003 (" in text, text[-3000:]
    assert f"resume: NO complete checkpoint in {ckpt}: 1 incomplete one(s) moved to {ckpt / 'incomplete'}; this " \
           "run STARTS FROM STEP 0" in text
    assert (ckpt / "incomplete" / "step-00000003").is_dir()
    assert inspect_checkpoint(ckpt / "step-00000006").complete and (ckpt / "latest").read_text() == "step-00000006"
    log.unlink()


def test_requeued_job_takes_its_own_run_lock_back(slurm, tmp_path):
    """A job killed without releasing its run lock (a node failure: the lock names a host that is gone, with a fresh
    heartbeat) is requeued under the same job id and takes its lock back; another job finds the same lock held and
    stops with exit status 2 before any step, leaving the lock as it was. Each job is held at submission so that
    its lock can be planted with the id SLURM gave it."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    lock = ckpt / "run.lock"
    env = {**FAST_ENV, "MAX_STEPS": "2", "CHECKPOINT_DIR": str(ckpt), "SBATCH_HOLD": "1"}

    def held_job_with_lock_of(owner: str) -> int:
        job_id = submitted_job(slurm.run("./train.sbatch", *FAST_ARGS, env=env))
        holder = job_id if owner == "itself" else job_id + 1000
        lock.write_text(json.dumps({"job_id": str(holder), "host": "node-that-failed", "pid": 4242,
                                    "started": "2026-01-01T00:00:00+0000", "token": "planted"}))
        assert slurm.run("scontrol", "release", str(job_id)).returncode == 0
        return job_id

    other = held_job_with_lock_of("another job")
    info = slurm.wait_job(other, timeout=240)
    text = job_log(other).read_text(errors="replace")
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "2:0", text[-3000:]
    assert f"is in use by another run (SLURM job {other + 1000}, host node-that-failed, pid 4242" in text
    assert "--force_unlock" in text and "Traceback" not in text and not list(ckpt.glob("step-*"))
    assert json.loads(lock.read_text())["token"] == "planted"

    own = held_job_with_lock_of("itself")
    info = slurm.wait_job(own, timeout=240)
    text = job_log(own).read_text(errors="replace")
    assert info["JobState"] == "COMPLETED", text[-3000:]
    assert f"run lock: taking over {lock} from node-that-failed pid 4242 (the same SLURM job {own} (requeued))" in text
    assert (ckpt / "step-00000002").is_dir() and not lock.exists()  # released at the end
    job_log(other).unlink()
    job_log(own).unlink()


def test_singlenode_runs_on_the_named_node(slurm, tmp_path):
    ckpt = tmp_path / "ckpt"
    result = slurm.run("./train-singlenode.sh", "node2", *FAST_ARGS,
                       env={**FAST_ENV, "MAX_STEPS": "2", "CHECKPOINT_DIR": str(ckpt)}, timeout=240)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    assert "task: rank 0/1 on node2" in out
    assert "world size 1 (0 GPUs per node)" in out
    job_id = int(re.search(r"Granted job allocation (\d+)", out).group(1))
    assert slurm.job(job_id).get("NodeList") in (None, "node2")
    assert (ckpt / "step-00000002").is_dir()


@pytest.mark.parametrize("launcher, env, message", [
    ("./train-singlenode.sh node9", {}, "unknown node 'node9': pick one of node[1-2]"),
    ("./train-pyxis-singlenode.sh node9", {}, "unknown node 'node9'"),
    ("./train.sbatch", {"NODES": "3"}, "NODES=3 but partition debug has 2 nodes"),
    ("./train.sbatch", {"PARTITION": "gpu"}, "PARTITION=gpu not found: set PARTITION to one of debug"),
    ("./train.sbatch", {"DS_CONFIG": "missing.json"}, "DS_CONFIG=missing.json: no such file"),
    ("./train.sbatch", {"PYTHON": "/nonexistent/python"}, "PYTHON=/nonexistent/python not found"),
    ("./train-pyxis.sbatch", {"CONTAINER_IMAGE": "/nonexistent/x.sqsh"}, "CONTAINER_IMAGE=/nonexistent/x.sqsh: no such file"),
])
def test_bad_input_fails_in_one_line_before_allocating(slurm, launcher, env, message):
    before = slurm.last_job_id()
    result = slurm.run(*launcher.split(), env=env)
    assert result.returncode == 1
    assert result.stdout == ""
    assert len(result.stderr.splitlines()) == 1 and message in result.stderr, result.stderr
    assert slurm.last_job_id() == before


def test_dry_run_prints_commands_and_submits_nothing(slurm, tmp_path):
    before = slurm.last_job_id()
    image = fake_image(tmp_path)
    env = {"MAX_STEPS": "5", "DRY_RUN": "1", "CONTAINER_IMAGE": str(image)}
    out = {}
    for launcher in ("./train.sbatch", "./train-pyxis.sbatch", "./train-singlenode.sh node1",
                     "./train-pyxis-singlenode.sh node1"):
        result = slurm.run(*launcher.split(), "--seed", "7", env=env)
        assert result.returncode == 0, result.stderr
        out[launcher] = result.stdout
    assert slurm.last_job_id() == before
    assert out["./train.sbatch"].startswith(f"+ sbatch {REPO_ROOT}/train.sbatch --seed 7\n")
    assert out["./train-pyxis.sbatch"].startswith(f"+ sbatch {REPO_ROOT}/train-pyxis.sbatch --seed 7\n")
    assert (f"+ salloc --nodes=1 --exclusive --job-name=train-singlenode --nodelist=node1 "
            f"{REPO_ROOT}/train-singlenode.sh --seed 7\n") in out["./train-singlenode.sh node1"]
    for text in out.values():
        assert "+ srun --ntasks-per-node=N --chdir=" in text
        assert text.rstrip().endswith("src/train_deepspeed.py --max_steps 5 --seed 7")
    for launcher in ("./train-pyxis.sbatch", "./train-pyxis-singlenode.sh node1"):
        assert f"--container-image={image} --container-mounts={REPO_ROOT}:{REPO_ROOT} " \
               f"--container-workdir={REPO_ROOT} bash -c" in out[launcher]
    # A GPU count that is set previews the step the job will run: one task per GPU, one on a node without GPUs.
    for gpus, tasks in (("0", "1"), ("2", "2")):
        result = slurm.run("./train.sbatch", env=dict(env, GPUS_PER_NODE=gpus))
        assert result.returncode == 0, result.stderr
        assert f"+ srun --ntasks-per-node={tasks} --chdir=" in result.stdout
    assert slurm.last_job_id() == before


def test_job_composes_the_same_training_command_with_and_without_container(slurm, tmp_path):
    """DRY_RUN=1 inside real batch jobs: the srun lines the jobs would run. Pyxis is not installed, so the
    container job can only print its line."""
    ckpt = tmp_path / "ckpt"
    image = fake_image(tmp_path)
    env = {"DRY_RUN": "1", "CHECKPOINT_DIR": str(ckpt), "CONTAINER_IMAGE": str(image),
           "CONTAINER_MOUNTS": "/data:/data:ro", "MAX_STEPS": "9"}
    (REPO_ROOT / "logs").mkdir(exist_ok=True)
    steps = {}
    for script, name in (("train.sbatch", "ds-train"), ("train-pyxis.sbatch", "ds-train-pyxis")):
        job_id = submitted_job(slurm.run("sbatch", script, "--seed", "3", env=env))
        info = slurm.wait_job(job_id, timeout=60)
        log = job_log(job_id, name)
        text = log.read_text(errors="replace")
        assert info["JobState"] == "COMPLETED", text
        assert "world size 2 (0 GPUs per node)" in text and "MASTER_ADDR=node1 MASTER_PORT=" in text
        steps[script] = next(line for line in text.splitlines() if line.startswith("+ srun "))
        log.unlink()
    bare, pyxis = steps["train.sbatch"], steps["train-pyxis.sbatch"]
    assert bare.startswith("+ srun --ntasks-per-node=1 --cpus-per-task=")
    assert f"--container-mounts={REPO_ROOT}:{REPO_ROOT},{ckpt}:{ckpt},/data:/data:ro " in pyxis
    assert f"--container-image={image} " in pyxis and f"--container-workdir={REPO_ROOT} " in pyxis
    command = f"src/train_deepspeed.py --max_steps 9 --checkpoint_dir {ckpt} --seed 3"
    assert bare.endswith(command) and pyxis.endswith(f" _ python {command}")
    assert bare.split(" bash -c ")[1].split(" _ ")[0] == pyxis.split(" bash -c ")[1].split(" _ ")[0]


def test_prepare_data_sbatch_tokenizes_on_both_nodes(slurm, tmp_path):
    """`./prepare-data.sbatch` as a CPU job on the two nodes: each node's task tokenizes its share of the shards (the
    shards' .done records name two processes), one of them writes the manifest, and the prepared tokens are those of
    a preparation in one process."""
    import os

    import numpy as np

    from model_utils.config.settings import DataConfig
    from model_utils.data.prepare import prepare

    data = tmp_path / "corpus.jsonl"
    data.write_text("".join(json.dumps({"text": f"document {i}: " + "the words of a corpus line " * 30}) + "\n"
                            for i in range(300)))
    out = tmp_path / "prepared"
    result = slurm.run("./prepare-data.sbatch", "--dataset", str(data), "--output", str(out), "--shard_mb", "0.02",
                       env={"PREPARE_PROCS": "1"})
    assert result.returncode == 0, result.stderr
    job_id = submitted_job(result)
    info = slurm.wait_job(job_id, timeout=240)
    log = job_log(job_id, "ds-prepare")
    text = log.read_text(errors="replace")
    assert info["JobState"] == "COMPLETED", text[-3000:]
    assert "2 node(s) prepare the data" in text
    done = [json.loads(p.read_text()) for p in (out / "shards").glob("*.done")]
    assert len(done) > 2 and len({d["pid"] for d in done}) == 2, done  # one tokenizing process per node's task

    def tokens(folder: Path) -> np.ndarray:
        manifest = json.loads((folder / "manifest.json").read_text())
        return np.concatenate([np.fromfile(folder / s["file"], dtype=manifest["dtype"])[:s["tokens"]]
                               for s in manifest["shards"] if s["split"] == "train"])

    alone = tmp_path / "alone"
    with open(os.devnull, "w") as quiet:
        prepare(DataConfig(dataset=str(data)), None, alone, num_proc=1, shard_mb=0.02, log=lambda *_: None,
                stream=quiet)
    np.testing.assert_array_equal(tokens(out), tokens(alone))
    log.unlink()
