"""Files the tests write as inputs (DeepSpeed configs, data files, a run lock of another run) and read back (plots),
shared by the unit and distributed tiers."""

from __future__ import annotations

import copy
import json
import os
import time

from conftest import REPO

from model_utils.core.run_dir import LOCK

SHIPPED = json.loads((REPO / "ds_config.json").read_text())


def ds_with(tmp_path, mutate):
    cfg = copy.deepcopy(SHIPPED)
    mutate(cfg)
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def set_key(path, value):
    def mutate(cfg):
        node = cfg
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return mutate


def jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def good_rows(n=50):
    return [{"text": f"document {i} " + "words " * 20} for i in range(n)]


def bad_jsonl_line(d):
    jsonl(d / "a.jsonl", good_rows())
    rows = good_rows(400)
    rows[299] = '{"text": "cut short'
    jsonl(d / "b.jsonl", rows)
    return d / "b.jsonl", "line 300 is not valid JSON"


def write_lock(directory, age_s=0.0, **holder):
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / LOCK
    path.write_text(json.dumps({"host": "node-elsewhere", "pid": 4242, "job_id": None, "started": "earlier",
                                "token": "theirs", **holder}))
    past = time.time() - age_s
    os.utime(path, (past, past))
    return path


def png_shape(path):
    import matplotlib.image

    return matplotlib.image.imread(path).shape[:2]


def mounted_tmpfs(mount, size: str):
    """A tmpfs of `size` (mount's -o size=) at the new directory `mount`, as a generator for a fixture: it yields the
    mount point and unmounts it afterwards. A test of a full or read-only filesystem is skipped where mounting is not
    allowed (not root, or a container without the right)."""
    import subprocess

    import pytest

    if os.geteuid() != 0:
        pytest.skip("mounting a small filesystem needs root")
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)], capture_output=True,
                          text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=True)


def refused_command_line(argv, capsys) -> str:
    """What parse_args prints for a command line it refuses: exit status 2, the problems, no usage and no traceback."""
    import pytest

    from model_utils.config.flags import parse_args
    from model_utils.core.exit_status import BAD_INPUT

    with pytest.raises(SystemExit) as stop:
        parse_args(argv)
    assert stop.value.code == BAD_INPUT
    err = capsys.readouterr().err
    assert "usage:" not in err and "Traceback" not in err
    return err
