"""A real SLURM cluster on this machine, for the launcher tests (pytest fixtures).

`slurm_cluster` (session) starts munge, slurmctld and two slurmd emulating the
nodes node1 and node2 on this host (Debian's slurm-wlm packages, which it installs
itself with .ci/install-system.sh when they are missing and it runs as root with
apt-get), with its configuration, state and logs under one
directory, and tears them down at the end of the session. It needs root. When
the cluster cannot be brought up it skips the tests with the reason, except
under CI (CI=true), where that is a failure.

`slurm` (per test) gives the cluster, with the session's data cache (conftest's `session_cache`) in the jobs'
environment, and cancels the test's jobs afterwards.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
NODES = ("node1", "node2")
CTLD_PORT = 16817  # not SLURM's 6817, so that a real installation is left alone
SLURMD_PORTS = (17001, 17002)
BASE_DIR = Path("/tmp") / f"dslm-slurm-{os.getuid()}"
HOSTS_MARK = "# deepspeed-lm-trainer test cluster"
# Every launcher setting, read from where it is defined (scripts/launch_common.sh: `: "${NAME:=default}"`), plus the
# one the launchers normalise without defining.
_LIBRARY = (REPO_ROOT / "scripts/launch_common.sh").read_text()
LAUNCHER_SETTINGS = sorted(set(re.findall(r'^: "\$\{([A-Z_]+):=', _LIBRARY, re.M)) | {"TORCH_CUDA_ARCH_LIST"})


def clean_env(**overrides) -> dict:
    """This environment without launcher settings or SLURM job variables, plus overrides."""
    env = {k: v for k, v in os.environ.items()
           if k not in LAUNCHER_SETTINGS and not k.startswith(("SLURM_", "SBATCH_", "SALLOC_", "SRUN_"))}
    env.update(overrides)
    return env


FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE",
                "PREEMPTED"}

SLURM_CONF = """\
ClusterName=dslmtest
FirstJobId={first_job_id}
SlurmctldHost={host}
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# Credential lifetime; it is also how long a requeued job waits before it starts again (default 120 s).
AuthInfo=cred_expire=10
StateSaveLocation={base}/state
SlurmdSpoolDir={base}/spool/%n
SlurmctldPidFile={base}/slurmctld.pid
SlurmdPidFile={base}/slurmd-%n.pid
SlurmctldLogFile={base}/slurmctld.log
SlurmdLogFile={base}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobRequeue=1
# SLURM manages GPUs here as on a GPU cluster; the nodes have none (the launcher's GPU check is tested with a
# stand-in nvidia-smi).
GresTypes=gpu
ReturnToService=2
SlurmdTimeout=300
SlurmctldTimeout=120
MinJobAge=600
KillWait=60
NodeName=node[1-2] NodeHostname={host} NodeAddr=127.0.0.1 CPUs={cpus} Port={port_lo}-{port_hi} State=UNKNOWN
PartitionName=debug Nodes=node[1-2] Default=YES MaxTime=INFINITE State=UP
"""


def _unavailable(reason: str):
    if os.environ.get("CI") == "true":
        pytest.fail(f"SLURM test cluster unavailable on CI: {reason}", pytrace=False)
    pytest.skip(f"SLURM test cluster unavailable: {reason}")


def _kill_pidfile(path: Path, timeout: float = 15.0):
    """Stop the daemon whose pid the file holds (one this fixture started), if that pid is still such a daemon."""
    try:
        pid = int(path.read_text().split()[0])
        name = Path(f"/proc/{pid}/comm").read_text().strip()
    except (OSError, ValueError, IndexError):
        path.unlink(missing_ok=True)
        return
    if name not in ("slurmctld", "slurmd", "munged"):
        path.unlink(missing_ok=True)
        return
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        path.unlink(missing_ok=True)
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.2)
    else:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    path.unlink(missing_ok=True)


@dataclass
class SlurmCluster:
    base: Path
    conf: Path
    env: dict = field(repr=False)
    nodes: tuple = NODES

    def run(self, *cmd, check=False, timeout=120, env=None, cwd=REPO_ROOT, **kw) -> subprocess.CompletedProcess:
        """Run a command with this cluster's SLURM_CONF (env adds variables)."""
        full_env = {**self.env, **(env or {})}
        return subprocess.run([str(c) for c in cmd], env=full_env, cwd=cwd, capture_output=True, text=True,
                              check=check, timeout=timeout, **kw)

    def job(self, job_id: int) -> dict:
        """scontrol's fields of a job ({} once SLURM forgot it)."""
        out = self.run("scontrol", "show", "job", "-o", str(job_id)).stdout
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def wait_job(self, job_id: int, timeout: float = 300, states=FINAL_STATES) -> dict:
        deadline = time.monotonic() + timeout
        info = {}
        while time.monotonic() < deadline:
            info = self.job(job_id)
            if info.get("JobState") in states:
                return info
            time.sleep(1)
        self.run("scancel", str(job_id))
        raise AssertionError(f"job {job_id} not in {sorted(states)} after {timeout}s: {info.get('JobState')}\n"
                             f"{self.logs_tail()}")

    def job_ids(self) -> list[int]:
        out = self.run("squeue", "-h", "-o", "%i").stdout
        return [int(j) for j in out.split()]

    def last_job_id(self) -> int:
        """The highest job id SLURM has handed out (0 before the first job)."""
        out = self.run("scontrol", "show", "config").stdout
        match = re.search(r"^NEXT_JOB_ID\s*=\s*(\d+)", out, re.M)
        return int(match.group(1)) - 1 if match else 0

    def wait_nodes_idle(self, timeout: float = 60):
        deadline = time.monotonic() + timeout
        states = ""
        while time.monotonic() < deadline:
            states = self.run("sinfo", "-h", "-N", "-o", "%N %T").stdout
            if states.count("idle") == len(self.nodes) and "*" not in states:
                return
            time.sleep(0.5)
        raise RuntimeError(f"nodes not idle after {timeout}s:\n{states}\n{self.logs_tail()}")

    def logs_tail(self, lines: int = 15) -> str:
        parts = []
        for log in sorted(self.base.glob("*.log")):
            text = log.read_text(errors="replace").splitlines()[-lines:]
            parts.append(f"--- {log.name}\n" + "\n".join(text))
        return "\n".join(parts)


def _munge_works() -> bool:
    try:
        enc = subprocess.run(["munge", "-n"], capture_output=True, timeout=10)
        return enc.returncode == 0 and subprocess.run(["unmunge"], input=enc.stdout, capture_output=True,
                                                      timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _start_munge() -> bool:
    """Start munged unless it already answers; True when this fixture started it."""
    if _munge_works():
        return False
    key = Path("/etc/munge/munge.key")
    if not key.exists():
        subprocess.run(["mungekey", "--create", "--keyfile", str(key)], check=True)
        shutil.chown(key, "munge", "munge")
        key.chmod(0o600)
    run_dir = Path("/run/munge")
    run_dir.mkdir(parents=True, exist_ok=True)
    shutil.chown(run_dir, "munge", "munge")
    run_dir.chmod(0o755)
    subprocess.run(["runuser", "-u", "munge", "--", "munged"], check=True, capture_output=True, timeout=30)
    for _ in range(50):
        if _munge_works():
            return True
        time.sleep(0.2)
    raise RuntimeError("munged started but `munge -n | unmunge` fails")


def _add_hosts_entry() -> bool:
    """node1 and node2 resolve to this machine (MASTER_ADDR is a node name)."""
    try:
        if all(socket.gethostbyname(n) for n in NODES):
            return False
    except OSError:
        pass
    with open("/etc/hosts", "a", encoding="utf-8") as f:
        f.write(f"127.0.0.1 {' '.join(NODES)} {HOSTS_MARK}\n")
    return True


def _remove_hosts_entry():
    hosts = Path("/etc/hosts")
    lines = hosts.read_text().splitlines(keepends=True)
    hosts.write_text("".join(line for line in lines if HOSTS_MARK not in line))


def _stop_daemons():
    for pidfile in [*BASE_DIR.glob("slurmd-*.pid"), BASE_DIR / "slurmctld.pid"]:
        _kill_pidfile(pidfile)


def _missing_slurm_commands() -> list[str]:
    return [c for c in ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol") if not shutil.which(c)]


@pytest.fixture(scope="session")
def slurm_cluster():
    if os.geteuid() != 0:
        _unavailable("needs root (slurmd runs jobs as any user, munged needs /run/munge)")
    missing = _missing_slurm_commands()
    if missing and shutil.which("apt-get"):
        # README's test command installs what the tests need: Debian's SLURM packages, once (a minute or two).
        print(f"\nslurm_cluster: {' '.join(missing)} missing; installing Debian's SLURM packages "
              "(.ci/install-system.sh)", flush=True)
        install = subprocess.run(["bash", str(REPO_ROOT / ".ci/install-system.sh")], capture_output=True, text=True,
                                 timeout=900)
        if install.returncode != 0:
            last = (install.stderr.strip().splitlines() or install.stdout.strip().splitlines() or ["no output"])[-1]
            _unavailable(f"installing SLURM failed: {last}")
        missing = _missing_slurm_commands()
    if missing:
        _unavailable(f"{' '.join(missing)} not installed and no apt-get here to install them "
                     "(Debian/Ubuntu: .ci/install-system.sh, as root)")

    # Daemons left by an interrupted earlier session hold the ports: stop them.
    _stop_daemons()
    shutil.rmtree(BASE_DIR, ignore_errors=True)
    for sub in ("state", "spool"):
        (BASE_DIR / sub).mkdir(parents=True)
    host = socket.gethostname().split(".")[0]
    conf = BASE_DIR / "slurm.conf"
    # Job ids differ between sessions, so that logs/ds-train_<id>.out of an earlier session is never appended to.
    first_job_id = 1000 + int(time.time()) % 60_000_000
    conf.write_text(SLURM_CONF.format(first_job_id=first_job_id, host=host, base=BASE_DIR, ctld_port=CTLD_PORT, cpus=os.cpu_count() or 1,
                                      port_lo=SLURMD_PORTS[0], port_hi=SLURMD_PORTS[1]))
    env = clean_env(SLURM_CONF=str(conf))
    cluster = SlurmCluster(BASE_DIR, conf, env)

    started_munge = added_hosts = False
    try:
        started_munge = _start_munge()
        added_hosts = _add_hosts_entry()
        subprocess.run(["slurmctld", "-f", str(conf)], check=True, capture_output=True, timeout=60)
        for node in NODES:
            subprocess.run(["slurmd", "-f", str(conf), "-N", node], check=True, capture_output=True, timeout=60)
        cluster.wait_nodes_idle()
    except (OSError, subprocess.SubprocessError, RuntimeError) as exc:
        detail = getattr(exc, "stderr", "") or ""
        _stop_daemons()
        _unavailable(f"{exc} {detail}\n{cluster.logs_tail()}")

    yield cluster

    cluster.run("scancel", "--full", "--user", "root")
    _stop_daemons()
    if started_munge:
        _kill_pidfile(Path("/run/munge/munged.pid"))
    if added_hosts:
        _remove_hosts_entry()


@pytest.fixture
def slurm(slurm_cluster, session_cache):
    """The session's cluster, with the session's data cache, and the jobs a test leaves cancelled afterwards."""
    slurm_cluster.env["DEEPSPEED_LM_CACHE"] = str(session_cache)
    before = slurm_cluster.last_job_id()
    yield slurm_cluster
    for job_id in slurm_cluster.job_ids():
        if job_id > before:
            slurm_cluster.run("scancel", "--full", str(job_id))
