"""The repository's root: the default DeepSpeed configs (ds_config.json, configs/) and the code version a checkpoint
records are found from it.
"""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[3]
