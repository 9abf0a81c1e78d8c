"""The one seam through which a user's own code enters a run: `--model FILE.py:FUNCTION` and `--dataset
FILE.py:FUNCTION` (or `package.module:FUNCTION`, importable from the working directory) name a function the trainer
calls. `is_user_function` tells such a name from a preset, a model directory or a dataset; `load_function` imports it,
answering a file, module or function that is not there with a Problem that names the flag.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
import sys
import zlib
from pathlib import Path

from model_utils.core.problems import Problem

# FILE.py:FUNCTION or dotted.module:FUNCTION (a Windows drive letter or a URL never matches: no dots before "://")
_SPEC = re.compile(r"^(?P<source>[^:]+\.py|[A-Za-z_][\w.]*):(?P<function>[A-Za-z_]\w*)$")


def is_user_function(value: str | None) -> bool:
    """Whether a --model or --dataset value names a function of the user's (FILE.py:FUNCTION, module:FUNCTION)."""
    return bool(value) and _SPEC.match(value) is not None


def split_spec(value: str) -> tuple[str, str]:
    """(the file or module, the function's name) of a FILE.py:FUNCTION or module:FUNCTION value."""
    found = _SPEC.match(value)
    return found["source"], found["function"]


def load_function(value: str, flag: str) -> tuple[object, Problem | None]:
    """(the function `value` names, None), or (None, the Problem: a missing file, a module that does not import, no
    such function, a name that is not callable). A file is imported as a module of its own name, once per process."""
    source, name = split_spec(value)
    try:
        module = _import(source)
    except FileNotFoundError:
        return None, Problem(f"--{flag}", value, f"{source}: no such file",
                             "give the path of your Python file (relative to the directory the trainer starts in, or "
                             "absolute) and the function in it, FILE.py:FUNCTION")
    except ModuleNotFoundError as e:
        return None, Problem(f"--{flag}", value, f"cannot import {source}: {e}",
                             "give FILE.py:FUNCTION, or a module importable from here (PYTHONPATH) as module:FUNCTION")
    except Exception as e:  # the user's module raised while importing: their error, named with its type
        return None, Problem(f"--{flag}", value, f"importing {source} raised {type(e).__name__}: {e}",
                             f"fix {source} (python -c 'import runpy; runpy.run_path(\"{source}\")' shows the "
                             "traceback)" if source.endswith(".py") else f"fix the module {source}")
    function = getattr(module, name, None)
    if function is None:
        defined = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_")
                         and getattr(v, "__module__", None) == module.__name__)
        return None, Problem(f"--{flag}", value, f"{source} defines no {name}",
                             f"name one of its functions ({', '.join(defined) or 'none defined'}) after the colon")
    if not callable(function):
        return None, Problem(f"--{flag}", value, f"{name} in {source} is a {type(function).__name__}, not a function",
                             "name a function that takes the run's settings and returns your object")
    return function, None


def _import(source: str):
    if not source.endswith(".py"):
        return importlib.import_module(source)
    path = Path(source).resolve()
    if not path.is_file():
        raise FileNotFoundError(source)
    stem = re.sub(r"\W", "_", path.stem)
    name = f"user_{stem}_{zlib.crc32(str(path).encode()):08x}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before running it: dataclasses and pickling look their module up by name
    sys.path.insert(0, str(path.parent))  # the file's own imports of its neighbours
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module
