"""benchmarks/your_model_timing.py on CPU: the preset's architecture through the extension point and the preset
itself each train their steps, and the script reports both sides and their ratio (the figure itself is a GPU's)."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import REPO


def test_the_timing_runs_both_sides(tmp_path):
    out = subprocess.run([sys.executable, str(REPO / "benchmarks" / "your_model_timing.py"), "--model", "tiny",
                          "--seq_len", "32", "--micro_batch_size", "2", "--steps", "3", "--warmup", "1", "--blocks",
                          "16", "--workdir", str(tmp_path), "--json", str(tmp_path / "r.jsonl")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    sides = json.loads((tmp_path / "r.jsonl").read_text())["sides"]
    assert [s["side"] for s in sides] == ["preset", "yours"] and all(s["steps"] == 2 for s in sides)
    assert "yours / preset speed:" in out.stdout
    assert "model of your own: " in (tmp_path / "yours.log").read_text()
