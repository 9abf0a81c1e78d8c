"""Shared fixtures: one data cache per test session, and a way to run the real trainer on N CPU processes."""

from __future__ import annotations

import fcntl
import functools
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "src"
TRAINER = SRC / "train_deepspeed.py"
sys.path.insert(0, str(SRC))
# Nothing may come from a hub during tests: fail fast instead of waiting on network timeouts.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))
from slurm_fixtures import *  # noqa: E402,F401,F403
from slurm_fixtures import LAUNCHER_SETTINGS  # noqa: E402

import preloaded  # noqa: E402


# Hermetic: what a user's shell commonly exports must not change a test's outcome. Every launcher setting
# (scripts/launch_common.sh), SLURM's job variables, a distributed rank environment and its OpenMP threads, GPU
# selection (the GPUs are hidden, below) and the overrides the trainer reads or refuses (GPU_MEMORY_GIB,
# GPU_PEAK_TFLOPS, W&B's, the retired DSLM_* switches) are dropped for the whole session; tests that need one set it
# themselves. The interpreter running pytest comes first on PATH, so `python3` in a launcher is the environment under
# test even when its virtualenv is not activated.
USER_ENVIRONMENT = ("SLURM_", "SBATCH_", "SALLOC_", "SRUN_", "DSLM_", "WANDB_")
for _name in list(os.environ):
    if (_name in LAUNCHER_SETTINGS or _name.startswith(USER_ENVIRONMENT)
            or _name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "OMP_NUM_THREADS", "MASTER_ADDR",
                         "MASTER_PORT", "CUDA_VISIBLE_DEVICES",
                         "GPU_MEMORY_GIB", "GPU_PEAK_TFLOPS", "DEEPSPEED_LM_CACHE", "VIRTUAL_ENV")):
        del os.environ[_name]
os.environ["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
# The tests run DeepSpeed's CPU path (gloo ranks) on any machine: with a GPU visible, DeepSpeed would take CUDA and
# NCCL, whose second rank has no GPU of its own on a one-GPU machine. The few tests that need GPUs ask for them
# (gpu_environment).
os.environ["CUDA_VISIBLE_DEVICES"] = ""

# Small and fast, but the real code path: 2 gloo ranks, the tiny Qwen3 preset, the embedded corpus.
FAST_ARGS = ["--seq_len", "64", "--micro_batch_size", "2", "--eval_iters", "2", "--log_interval", "1",
             "--eval_interval", "0"]


TIERS = ("unit", "distributed", "slurm")

# Hermetic caches: every cache a test's process or its subprocesses (trainers, launchers, SLURM jobs) would write lives
# in this session's temporary folder, never in the user's ~/.cache: a lock file or a build another environment left
# there must not change a test's outcome. Torch's extension folder is one per session, so DeepSpeed's ops (cpu_adam,
# the shared-memory collectives) build once per session; the dataset cache is the one session_cache fills.
CACHE_SETTINGS = {"DEEPSPEED_LM_CACHE": "deepspeed-lm", "TORCH_EXTENSIONS_DIR": "torch-extensions",
                  "HF_HOME": "huggingface", "HF_DATASETS_CACHE": "huggingface/datasets",
                  "TRITON_CACHE_DIR": "triton", "TORCHINDUCTOR_CACHE_DIR": "torchinductor"}


_CACHES: list[Path] = []
# The session's cache folder, made by the process that runs pytest and shared by its workers (pytest-xdist starts them
# with its environment after pytest_configure): DeepSpeed's ops build once per session, not once per worker.
SHARED_CACHES = "DEEPSPEED_LM_TEST_SESSION_CACHES"


def pytest_configure(config):
    if os.environ.get("PYTEST_XDIST_WORKER") and os.environ.get(SHARED_CACHES):
        root = Path(os.environ[SHARED_CACHES])
    else:
        root = Path(tempfile.mkdtemp(prefix="dslm-test-caches-"))
        _CACHES.append(root)  # removed by the process that made it, once the workers are gone
        os.environ[SHARED_CACHES] = str(root)
    for name, folder in CACHE_SETTINGS.items():
        (root / folder).mkdir(parents=True, exist_ok=True)
        os.environ[name] = str(root / folder)
    preloaded.SESSION_ENV.update(os.environ)  # the environment trainer ranks are forked with (tests/preloaded.py)


def pytest_unconfigure(config):
    preloaded.stop()
    for root in _CACHES:
        shutil.rmtree(root, ignore_errors=True)


# The tiers run in parallel (pytest-xdist, `-n auto --dist loadscope` in pyproject.toml): a trainer run spends much of
# its time in one rank's work (data, export, summary) while the other waits, a SLURM job in its scheduling, so one
# worker more than the cores keeps them busy (2 cores: 3 workers, 12.5 min for the suite against 14.3 with 2 and 25.5
# with none). A module's tests stay on one worker (loadscope), so its shared runs (module fixtures) run once, and the
# SLURM tier, one module, uses the one local cluster. A run of a few files or test ids takes no workers: starting them
# (each imports the libraries) would cost more than it saves. PYTEST_XDIST_AUTO_NUM_WORKERS=N sets the count.
MAX_WORKERS = 4


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config):
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return int(os.environ["PYTEST_XDIST_AUTO_NUM_WORKERS"])
    named = [arg for arg in config.args if not Path(arg.split("::")[0]).is_dir()]
    if config.args and len(named) == len(config.args) and len(named) <= 2:
        return 0
    return max(2, min(MAX_WORKERS, len(os.sched_getaffinity(0)) + 1))


# `pytest -m quick`: the unit tier and, of the slower tiers, one test of each journey a change most often breaks (a
# run that trains, checkpoints and exports; an exact resume after kill -9; a fault in a save; supervised fine-tuning
# with LoRA; a job across two SLURM nodes): the check before a commit. The whole suite is the check before a merge.
QUICK = ("tests/distributed/test_training.py::test_zero_stage_trains_checkpoints_and_exports[ds_config.json]",
         "tests/distributed/test_training.py::test_resume_after_kill_9_is_exact",
         "tests/distributed/test_save_faults.py::test_kill_9_of_one_rank_before_the_manifest[in-the-background]",
         "tests/distributed/test_supervised_fine_tuning.py::test_a_lora_run_resumes_exactly_from_adapters_and_optimizer_state",
         "tests/distributed/test_preference_tuning.py::test_a_dpo_run_resumes_exactly_with_the_step0_reference",
         "tests/slurm/test_slurm_jobs.py::test_sbatch_trains_on_two_nodes")


# The order the tiers run in, longest modules first: the SLURM tier (one module of jobs), then the trainer runs, then
# the many short unit modules, which keep every worker busy to the end.
TIER_ORDER = ("slurm", "distributed", "unit")


def pytest_collection_modifyitems(items):
    """Each test is marked with its tier, the folder under tests/ it lives in (`pytest -m "not slurm"` and the like);
    tests/unit has a folder per folder of src/model_utils. The unit tier and the tests named in QUICK are marked
    quick. The tiers run in TIER_ORDER, each module's tests together and in their order."""
    tests = Path(__file__).resolve().parent
    tiers = {}
    for item in items:
        tier = Path(item.fspath).resolve().relative_to(tests).parts[0]
        tiers[item.nodeid] = tier
        if tier in TIERS:
            item.add_marker(tier)
        if tier == "unit" or item.nodeid in QUICK:
            item.add_marker("quick")
    items.sort(key=lambda item: TIER_ORDER.index(tiers[item.nodeid]) if tiers[item.nodeid] in TIER_ORDER else 0)


# A test that takes longer than its tier's limit here says why in its docstring (or gets faster); the run's summary
# names those that do not. Only the test's own call counts: a module's shared run is its fixture's time.
SLOW_S = {"unit": 5.0, "distributed": 30.0, "slurm": 30.0}
_UNEXPLAINED: list[tuple[float, str]] = []


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    tier = next((t for t in TIERS if item.get_closest_marker(t)), None)
    if report.when == "call" and tier and report.duration > SLOW_S[tier]:
        if not (getattr(item, "function", None) and (item.function.__doc__ or "").strip()):
            report.user_properties.append(("slow_without_docstring", True))  # reaches the summary from any worker


def pytest_runtest_logreport(report):
    if any(tuple(prop) == ("slow_without_docstring", True) for prop in report.user_properties):
        _UNEXPLAINED.append((report.duration, report.nodeid))


def pytest_sessionfinish(session):
    """A worker hands the programs it started as real processes to the summary (pytest_testnodedown)."""
    if hasattr(session.config, "workeroutput"):
        session.config.workeroutput["fresh_starts"] = dict(preloaded.FRESH_STARTS)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    for why, count in getattr(node, "workeroutput", {}).get("fresh_starts", {}).items():
        preloaded.FRESH_STARTS[why] = preloaded.FRESH_STARTS.get(why, 0) + count


def pytest_terminal_summary(terminalreporter):
    if preloaded.FRESH_STARTS:  # a variable that drifted in the session would make every later rank a real process
        terminalreporter.section("Python programs started as real processes (tests/preloaded.py), by reason")
        for why, count in sorted(preloaded.FRESH_STARTS.items(), key=lambda item: -item[1]):
            terminalreporter.write_line(f"{count:5d} {why[:200]}")
    if _UNEXPLAINED:
        terminalreporter.section("slow tests whose docstring does not say why (unit > 5 s, others > 30 s)")
        for duration, nodeid in sorted(_UNEXPLAINED, reverse=True):
            terminalreporter.write_line(f"{duration:6.1f}s {nodeid}")


@pytest.fixture(scope="session")
def session_cache(tmp_path_factory) -> Path:
    """One cache (embedded corpus, packed tokens) for every trainer the tests start; built once, here."""
    cache = Path(os.environ["DEEPSPEED_LM_CACHE"])  # the session's own (pytest_configure)
    from model_utils.config.settings import DataConfig
    from model_utils.data.sources import resolve_source
    from model_utils.data.tokenizer import load_tokenizer
    from model_utils.data.tokens import build_token_files, cache_dir_for

    cfg = DataConfig()
    tokenizer = load_tokenizer(None)
    out = cache_dir_for(cfg, resolve_source(cfg), tokenizer)
    with open(cache / "session-cache.lock", "w") as lock:  # the session's other workers wait for the one building it
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / "meta.json").exists():
            build_token_files(cfg, tokenizer, out, log=lambda *_: None)
    return cache


def copy_session_op(name: str, build_directory: Path) -> bool:
    """Copy this session's build of DeepSpeed's op `name` (torch's extensions folder) into `build_directory`, up to date
    for ninja, so that a run whose extensions folder is elsewhere loads it instead of building it again (~40 s of a
    core). Only for a torch that locks its builds with an OS lock (>= 2.14): a FileBaton torch reads a module newer
    than a lock file as a finished build's. False where there is nothing to copy."""
    import torch

    from model_utils.runtime.build_locks import torch_locks_with_os_lock

    built = Path(os.environ["TORCH_EXTENSIONS_DIR"]) / name
    if not torch_locks_with_os_lock(torch.__version__) or not (built / f"{name}.so").exists():
        return False
    shutil.copytree(built, build_directory / name, ignore=shutil.ignore_patterns("lock"))
    return True


def gpu_environment() -> dict:
    """The environment for a subprocess that uses this machine's GPUs (all of them: the hermetic session hides them)."""
    return {name: value for name, value in os.environ.items() if name != "CUDA_VISIBLE_DEVICES"}


def run_python_on_gpus(code: str, timeout: int = 120) -> subprocess.CompletedProcess:
    """`python -c code` in a subprocess that sees this machine's GPUs and imports the package from src/: how a test
    checks what only a GPU does (pinned host memory, CUDA streams) inside the hermetic session."""
    env = gpu_environment()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SRC), env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout,
                          check=False)


@functools.cache
def gpu_count() -> int:
    """This machine's GPUs, counted in a subprocess that sees them (0 without CUDA)."""
    done = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.device_count())"],
                          env=gpu_environment(), capture_output=True, text=True, timeout=120)
    return int(done.stdout.strip() or 0) if done.returncode == 0 else 0


@dataclass
class TrainerRun:
    returncodes: list[int]
    outputs: list[str]  # combined stdout+stderr per rank
    checkpoint_dir: Path

    @property
    def returncode(self) -> int:
        return max(self.returncodes, key=abs)

    @property
    def output(self) -> str:
        return self.outputs[0]

    def metrics(self) -> list[dict]:
        path = self.checkpoint_dir / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def train_records(self) -> list[dict]:
        return [r for r in self.metrics() if "loss" in r]

    def train_records_by_step(self) -> dict[int, dict]:
        """A resumed run appends to metrics.jsonl; the last record of each step is the one that counts."""
        return {r["step"]: r for r in self.train_records()}

    def losses_by_step(self) -> dict[int, float]:
        """Each step's training loss, from the last record of the step."""
        return {step: r["loss"] for step, r in self.train_records_by_step().items()}


_PORTS_PER_WORKER = 1000
_port_counter = itertools.count()


def rendezvous_port() -> int:
    """A free port for a test run's rendezvous (MASTER_PORT). Not the kernel's pick (`bind(("", 0))`): that comes from
    the ephemeral range, where the connections of the ranks that other workers run at the same time take their local
    ports, and one of them took a test's port between its pick and rank 0's bind (rank 0 died of EADDRINUSE, rank 1
    waited). These lie below that range, in a block of their own for each xdist worker."""
    import socket

    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    base = 10000 + (worker % 20) * _PORTS_PER_WORKER  # below 32768, the lowest default ephemeral port
    for _ in range(_PORTS_PER_WORKER):
        port = base + next(_port_counter) % _PORTS_PER_WORKER
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:  # still held by an earlier run of this worker
                continue
            return port
    raise RuntimeError(f"no free port in {base}-{base + _PORTS_PER_WORKER - 1} for this test worker")


def rank_environment(rank: int, nproc: int, port: int, env: dict | None = None) -> dict:
    """The environment of one of `nproc` trainer ranks on this machine, as srun or torchrun give it (RANK, WORLD_SIZE,
    MASTER_*), one OpenMP thread each; `env` adds to it, a None value unsets."""
    rank_env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
                    LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                    OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    rank_env.update(env or {})
    return {name: value for name, value in rank_env.items() if value is not None}


class Trainer:
    """Start the trainer as N separate rank processes (as srun does: RANK/WORLD_SIZE/MASTER_* in the environment)."""

    def __init__(self, checkpoint_dir: Path, args: list[str], nproc: int = 2, env: dict | None = None):
        self.checkpoint_dir = checkpoint_dir
        port = rendezvous_port()
        self.logs = [checkpoint_dir.parent / f"{checkpoint_dir.name}-rank{r}-{time.monotonic_ns()}.log" for r in range(nproc)]
        self.procs = []
        for rank in range(nproc):
            rank_env = rank_environment(rank, nproc, port, env)
            log = open(self.logs[rank], "w")
            self.procs.append(preloaded.Popen(
                [sys.executable, str(TRAINER), "--checkpoint_dir", str(checkpoint_dir), *args],
                cwd=REPO, env=rank_env, stdout=log, stderr=subprocess.STDOUT))

    def wait(self, timeout: float = 600) -> TrainerRun:
        deadline = time.monotonic() + timeout
        codes = []
        for p in self.procs:
            try:
                codes.append(p.wait(timeout=max(1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                for q in self.procs:
                    q.kill()
                raise
        return TrainerRun(codes, [log.read_text() for log in self.logs], self.checkpoint_dir)

    def wait_for(self, predicate, timeout: float = 300, poll: float = 0.05):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return True
            if all(p.poll() is not None for p in self.procs):
                return False
            time.sleep(poll)
        raise TimeoutError("condition not reached")


def run_trainer(checkpoint_dir: Path, args: list[str], nproc: int = 2, env: dict | None = None,
                timeout: float = 600) -> TrainerRun:
    return Trainer(checkpoint_dir, args, nproc, env).wait(timeout)


def kill_after_checkpoint_then_resume(checkpoint_dir: Path, args: list[str], step: int,
                                      env: dict | None = None) -> TrainerRun:
    """Every rank killed (-9) once the checkpoint of `step` is complete, then the same command again: the resumed
    run, checked to have resumed from that checkpoint."""
    import signal

    first = Trainer(checkpoint_dir, args, env=env)
    assert first.wait_for(lambda: (checkpoint_dir / f"step-{step:08d}" / "manifest.json").exists())
    for p in first.procs:
        p.send_signal(signal.SIGKILL)
    first.wait()
    resumed = run_trainer(checkpoint_dir, args, env=env)
    assert_ok(resumed)
    assert "resume: continuing from" in resumed.output and f"step-{step:08d}" in resumed.output
    return resumed


def assert_ok(run: TrainerRun):
    assert run.returncode == 0, "trainer failed:\n" + "\n----\n".join(o[-4000:] for o in run.outputs)


def preflight_command(args, env, cwd):
    """The command line, as a user runs it."""
    full_env = dict(os.environ, **env)
    full_env.setdefault("WORLD_SIZE", "1")
    t0 = time.monotonic()
    proc = preloaded.run([sys.executable, str(TRAINER), "--preflight", *args], cwd=cwd, env=full_env,
                         capture_output=True, text=True, timeout=120)
    return proc, time.monotonic() - t0


def require_bitsandbytes() -> None:
    """QLoRA's tests need bitsandbytes (the test extra installs it): without it they skip and say why, and under CI
    (CI=true), where the extra is installed, they fail."""
    import importlib.util

    if importlib.util.find_spec("bitsandbytes") is None:
        reason = "bitsandbytes is not installed (pip install -e '.[test]' installs it)"
        if os.environ.get("CI") == "true":
            pytest.fail(reason, pytrace=False)
        pytest.skip(reason, allow_module_level=True)
