"""./train-singlenode.sh outside SLURM for real: it starts its ranks itself, forwards a stop signal, and exits with
the trainer's status (75 after a signal's checkpoint, 2 for bad input, a failing rank's own status)."""

from __future__ import annotations

import re
import signal
import subprocess
import sys

from launching import launch, lib
from slurm_fixtures import REPO_ROOT, clean_env


def test_standalone_run_exits_with_the_trainers_status(tmp_path, session_cache):
    """./train-singlenode.sh outside SLURM starts its ranks itself: TERM reaches both ranks, they save and stop, and
    the launcher's status is the trainer's 75, with no traceback; bad input is the trainer's 2; a rank that fails
    stops the other and its status is the launcher's."""
    ckpt = tmp_path / "ck"
    env = clean_env(MAX_STEPS="400", CHECKPOINT_DIR=str(ckpt), DEEPSPEED_LM_CACHE=str(session_cache),
                    OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    run = subprocess.Popen(["./train-singlenode.sh", "--seq_len", "64", "--micro_batch_size", "2", "--log_interval",
                            "1", "--eval_interval", "0", "--checkpoint_freq", "1000"], cwd=REPO_ROOT, env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    lines = []
    for line in run.stdout:
        lines.append(line)
        if re.match(r"step 3 \|", line):
            run.send_signal(signal.SIGTERM)
            break
    lines += run.stdout.readlines()
    out = "".join(lines)
    assert run.wait(timeout=120) == 75, out[-4000:]
    assert "TERM: forwarding to the 2 ranks" in out and "Traceback" not in out, out[-4000:]
    assert "training finished with status 75" in out and "run the same command again to resume" in out
    saved = (ckpt / "latest").read_text().strip()
    assert int(saved.removeprefix("step-")) >= 3 and (ckpt / saved).is_dir(), saved

    bad = launch("./train-singlenode.sh", "--dataset", str(tmp_path / "missing.jsonl"), timeout=300,
                 DEEPSPEED_LM_CACHE=str(session_cache), OMP_NUM_THREADS="1")
    assert bad.returncode == 2, bad.stdout[-3000:] + bad.stderr[-3000:]
    assert "missing.jsonl: this path does not exist" in bad.stdout + bad.stderr

    # One rank failing (here: a trainer that cannot start on rank 1) ends the run with that rank's status.
    crash = lib('RANK_STOP_GRACE=5; run_local_ranks 2 "$PYTHON" -c "import os, sys, time; '
                'sys.exit(3) if os.environ[\'RANK\'] == \'1\' else time.sleep(60)" && s=0 || s=$?; echo "status $s"',
                PYTHON=sys.executable)
    assert crash.stdout.rstrip().endswith("status 3"), crash.stdout + crash.stderr
    assert "rank 1 exited with status 3: stopping the other ranks" in crash.stdout
