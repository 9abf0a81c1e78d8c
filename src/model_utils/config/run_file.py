"""A run in one file: `--config FILE.yaml` holds flags by their names, one `name: value` a line (flags.py parses each
as the command line would, which overrides them); every run writes its effective configuration in that form to
CHECKPOINT_DIR/config.yaml, every flag with the value the run took, so that `--config` on it runs the same again.
pyyaml is imported where a file is read or written: --help and the configuration checks run on a bare Python.
"""

from __future__ import annotations

import os
from pathlib import Path

from model_utils.config.settings import SECTIONS, TrainConfig, flag_fields
from model_utils.core.problems import Problem
from model_utils.core.repo import REPO_ROOT

FIX = "write one `flag_name: value` a line (configs/runs/ has examples)"


def resolve(config: str) -> Path:
    """--config as found: relative to the working directory, else to the repository (configs/runs/ from anywhere)."""
    path = Path(config)
    if not path.is_absolute() and not path.exists() and (REPO_ROOT / path).exists():
        return REPO_ROOT / path
    return path


def read(config: str) -> tuple[dict, list[Problem]]:
    """The file's `name: value` pairs, or the problem that keeps them from being read (named with the file)."""
    path = resolve(config)
    try:
        import yaml
    except ImportError:
        return {}, [Problem("--config", config, "needs pyyaml, which this Python lacks", "pip install pyyaml (or the "
                            "project, pip install -e ., which depends on it)")]
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}, [Problem("--config", config, "file not found", "give the path of a YAML file of flags, e.g. "
                                                                  "--config configs/runs/pretrain.yaml")]
    except (OSError, UnicodeDecodeError) as error:
        return {}, [Problem("--config", config, f"cannot be read ({getattr(error, 'strerror', None) or error})",
                            "give the path of a readable YAML file of flags")]
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        return {}, [Problem("--config", config, f"is not valid YAML{where}: {getattr(error, 'problem', None) or error}",
                            FIX)]
    if data is None:
        return {}, []
    if not isinstance(data, dict):
        return {}, [Problem("--config", config, f"holds a {type(data).__name__}, not flags by name", FIX)]
    problems = [Problem(f"{config}: {key!r}", value, "is not a flag's name (YAML read the key as "
                        f"{type(key).__name__})", "write the flag's name as the key, e.g. max_steps: 300")
                for key, value in data.items() if not isinstance(key, str)]
    return {key: value for key, value in data.items() if isinstance(key, str)}, problems


def text(cfg: TrainConfig, command: str) -> str:
    """The effective configuration as a --config file: every flag, section by section, in the order of --help."""
    import yaml

    lines = ["# The effective configuration of the run in this directory: every flag with the value it took (null: the",
             "# default the trainer derives, such as --seq_len from the model). Run it again, or change a flag:",
             f"#   python src/train_deepspeed.py --config {cfg.checkpoint.run_dir.config} [--max_steps N ...]",
             f"# Written by: {command}"]
    sections = [(name, first_sentence(section.__doc__), flag_fields(section)) for name, section in SECTIONS.items()]
    sections.append(("run", "The seed and the modes.", flag_fields(TrainConfig)))
    for name, doc, fields in sections:
        lines += ["", f"# {name}: {doc}"]
        lines += [yaml.safe_dump({f.name: cfg.flag(f.name)}, default_flow_style=False, width=float("inf"),
                                 allow_unicode=True).rstrip("\n") for f in fields]
    return "\n".join(lines) + "\n"


def first_sentence(text: str) -> str:
    return " ".join(text.split()).split(". ")[0].rstrip(".") + "."


def write(cfg: TrainConfig, command: str) -> Path:
    """Write CHECKPOINT_DIR/config.yaml whole (a reader never sees half of it); OSError is the caller's."""
    path = cfg.checkpoint.run_dir.config
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    partial.write_text(text(cfg, command), encoding="utf-8")
    os.replace(partial, path)
    return path
