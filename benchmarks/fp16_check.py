"""fp16 with dynamic loss scaling on one GPU (configs/fp16.json; on CPU it resolves to fp32, so only a GPU runs it):

- the run trains in fp16 and logs its loss scale every step;
- an overflow is skipped and counted: the scale starts high (2^24) and grows every 4 clean steps (loss_scale_window 4),
  so gradients overflow at the start and again each time the scale grows past what they allow; every overflow the log
  reports is one update DeepSpeed skipped (skipped_steps), and the scale halves after it;
- a resume is exact: killed (SIGKILL) once step 12's checkpoint is complete, then the same command; the loss scale and
  the skipped updates of steps 13-24 equal the uninterrupted run's (a scaler started afresh would begin at 2^24 and
  overflow again), and so do the losses, to the spread of two uninterrupted runs (GPU kernels need not be bitwise
  reproducible; on one that is, the resume must be bitwise equal).

    python benchmarks/fp16_check.py --out /tmp/fp16-check      # exit 0: every check held; 1: the failed checks

benchmarks/journey.sh runs it as the fp16 journey. It uses the machine's first GPU, the tiny preset and the embedded
corpus (about a minute on an H100).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TRAINER = REPO / "src" / "train_deepspeed.py"
INITIAL_SCALE_POWER = 24
MAX_STEPS, SAVE_AT = 24, 12
FLAGS = ["--model", "tiny", "--seq_len", "128", "--micro_batch_size", "4", "--max_steps", str(MAX_STEPS),
         "--checkpoint_freq", str(SAVE_AT), "--log_interval", "1", "--eval_interval", "0", "--eval_iters", "1",
         "--no-export", "--seed", "5", "--no-tensorboard"]
OVERFLOW = "fp16 gradients overflowed; update skipped"


def fp16_config(out: Path) -> Path:
    """configs/fp16.json, its scaler set to overflow within the run: a high start, growth every 4 clean steps, and a
    halving at every overflow (hysteresis 1)."""
    config = json.loads((REPO / "configs" / "fp16.json").read_text())
    config["fp16"].update(initial_scale_power=INITIAL_SCALE_POWER, loss_scale_window=4, hysteresis=1)
    path = out / "fp16-overflowing.json"
    path.write_text(json.dumps(config, indent=2))
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(ckpt: Path, config: Path, log: Path) -> subprocess.Popen:
    """One rank on the first GPU, as srun gives it."""
    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()),
               CUDA_VISIBLE_DEVICES=os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or "0")
    with open(log, "a") as out:
        return subprocess.Popen([sys.executable, str(TRAINER), "--checkpoint_dir", str(ckpt), "--ds_config",
                                 str(config), *FLAGS], cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)


def records(ckpt: Path) -> dict[int, dict]:
    """The last training record of each step (a resumed run appends)."""
    lines = (ckpt / "metrics.jsonl").read_text().splitlines() if (ckpt / "metrics.jsonl").exists() else []
    return {r["step"]: r for r in map(json.loads, lines) if "loss" in r}


def uninterrupted(out: Path, config: Path, name: str) -> tuple[dict[int, dict], str]:
    ckpt, log = out / name, out / f"{name}.log"
    code = start(ckpt, config, log).wait()
    text = log.read_text(errors="replace")
    if code != 0:
        raise SystemExit(f"fp16 check: the {name} run exited {code}; its log: {log}\n{text[-3000:]}")
    return records(ckpt), text


def killed_then_resumed(out: Path, config: Path) -> tuple[dict[int, dict], str]:
    ckpt, log = out / "resumed", out / "resumed.log"
    first = start(ckpt, config, log)
    manifest = ckpt / f"step-{SAVE_AT:08d}" / "manifest.json"
    while not manifest.exists():
        if first.poll() is not None:
            raise SystemExit(f"fp16 check: the run to be killed exited {first.returncode} before step {SAVE_AT}'s "
                             f"checkpoint; its log: {log}")
        time.sleep(0.05)
    first.send_signal(signal.SIGKILL)
    first.wait()
    code = start(ckpt, config, log).wait()
    text = log.read_text(errors="replace")
    if code != 0:
        raise SystemExit(f"fp16 check: the resumed run exited {code}; its log: {log}\n{text[-3000:]}")
    return records(ckpt), text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("/tmp/fp16-check"), help="Folder for the runs (emptied).")
    out = parser.parse_args().out
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    config = fp16_config(out)

    reference, text = uninterrupted(out, config, "reference")
    again, _ = uninterrupted(out, config, "again")
    resumed, resumed_text = killed_then_resumed(out, config)

    failed = []

    def check(ok: bool, what: str):
        print(f"fp16 check: {'ok' if ok else 'FAILED'}: {what}")
        if not ok:
            failed.append(what)

    steps = list(range(1, MAX_STEPS + 1))
    check("precision fp16 (dynamic loss scaling)" in text, "the run trains in fp16 with dynamic loss scaling")
    check(sorted(reference) == steps and all("loss_scale" in reference[s] for s in steps),
          "every step's record holds the loss scale")
    overflows = text.count(OVERFLOW)
    skipped = reference.get(MAX_STEPS, {}).get("skipped_steps")
    check(overflows >= 1 and skipped == overflows,
          f"overflows skipped and counted: {overflows} reported, skipped_steps {skipped}")
    scales = [reference[s].get("loss_scale") for s in steps if s in reference]
    check(bool(scales) and scales[0] is not None and scales[0] < 2 ** INITIAL_SCALE_POWER,
          f"the scale came down from 2^{INITIAL_SCALE_POWER} after the first overflow: {scales[:1]}")
    early = [r["skipped_steps"] for s, r in reference.items() if s <= SAVE_AT]
    check(bool(early) and max(early) >= 1, f"at least one overflow before step {SAVE_AT}'s checkpoint")
    check("resume: continuing from" in resumed_text and f"at step {SAVE_AT}" in resumed_text,
          f"the second start resumed from step {SAVE_AT}")
    after = list(range(SAVE_AT + 1, MAX_STEPS + 1))
    check([(resumed.get(s, {}).get("loss_scale"), resumed.get(s, {}).get("skipped_steps")) for s in after]
          == [(reference.get(s, {}).get("loss_scale"), reference.get(s, {}).get("skipped_steps")) for s in after],
          f"steps {after[0]}-{after[-1]}: the resumed loss scale and skipped updates equal the uninterrupted run's")
    spread = max(abs(again[s]["loss"] - reference[s]["loss"]) for s in after)
    gap = max(abs(resumed[s]["loss"] - reference[s]["loss"]) for s in after if s in resumed)
    check(len([s for s in after if s in resumed]) == len(after) and gap <= spread,
          f"steps {after[0]}-{after[-1]}: resumed losses differ from the uninterrupted run's by {gap:.3g} at most; "
          f"two uninterrupted runs by {spread:.3g}")
    print(f"fp16 check: {'all checks held' if not failed else f'{len(failed)} failed'} ({out})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
