"""The package's layers (src/model_utils/__init__.py): each folder imports only the folders below it, no module takes
a private name from another, and the imports (those inside functions too) make no circle."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
LAYERS = ["core", "patches", "config", "checkpoint", "runtime", "data", "models", "planning", "train"]


def _modules() -> dict[str, Path]:
    out = {}
    for path in (SRC / "model_utils").rglob("*.py"):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(modules: dict[str, Path]) -> list[tuple[str, str, str]]:
    """(importing module, imported module, name) for every project import, wherever it stands."""
    found = []
    for module, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom):
                continue
            target = node.module or ""
            if node.level:  # relative: from the importing module's package
                package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
                target = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else []))
            if target.startswith("model_utils"):
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    found.append((module, sub if sub in modules else target, alias.name))
    return found


def _layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in LAYERS) else None


def test_each_folder_imports_only_the_folders_below_it():
    upward = [(a, b) for a, b, _ in _imports(_modules())
              if _layer(a) in LAYERS and _layer(b) in LAYERS and LAYERS.index(_layer(b)) > LAYERS.index(_layer(a))]
    assert not upward, upward


def test_no_private_name_is_imported_from_another_module():
    private = [(a, b, name) for a, b, name in _imports(_modules())
               if name.startswith("_") and not name.startswith("__") and a != b]
    assert not private, private


def test_the_imports_make_no_circle():
    modules = _modules()
    edges: dict[str, set[str]] = {m: set() for m in modules}
    for a, b, _ in _imports(modules):
        if a != b and b in modules:
            edges[a].add(b)
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> list[str] | None:
        state[module] = 1
        for nxt in sorted(edges[module]):
            if state.get(nxt) == 1:
                return path + [nxt]
            if nxt not in state and (circle := visit(nxt, path + [nxt])):
                return circle
        state[module] = 2
        return None

    for module in sorted(modules):
        if module not in state:
            assert (circle := visit(module, [module])) is None, " -> ".join(circle)


def test_test_files_have_unique_names():
    """The tiers are folders without __init__.py, so pytest imports each test file by its bare name: two files of one
    name in different tiers pass when each tier runs alone and stop `python -m pytest` (all tiers) at collection."""
    tests = Path(__file__).resolve().parents[1]
    by_name: dict[str, list[str]] = {}
    for path in tests.rglob("test_*.py"):
        by_name.setdefault(path.name, []).append(str(path.relative_to(tests)))
    assert {name: paths for name, paths in by_name.items() if len(paths) > 1} == {}
