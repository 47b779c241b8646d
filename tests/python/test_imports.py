"""Every import inside tide resolves, also the ones only a GPU path reaches.

Imports placed inside functions (CUDA-only branches, optional features) run only when that
branch does: the first GPU run found `from ._pool import ...` in tide/fsdp pointing at a
module that lives one package up. This walks every module's syntax tree and checks each
relative import and each import of tide against the package itself, on any machine."""
from __future__ import annotations

import ast
import importlib
import os

import pytest

import tide

PACKAGE = os.path.dirname(tide.__file__)


def _modules():
    for dirpath, _, files in os.walk(PACKAGE):
        for f in sorted(files):
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                rel = os.path.relpath(path, os.path.dirname(PACKAGE))[:-3].replace(os.sep, ".")
                yield path, rel[: -len(".__init__")] if rel.endswith(".__init__") else rel


def _imports(path, module):
    """(line, imported module, names) for each import of tide in the file, resolved."""
    is_package = path.endswith("__init__.py")
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target == "tide" or target.startswith("tide."):
                yield node.lineno, target, [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "tide" or a.name.startswith("tide."):
                    yield node.lineno, a.name, []


CASES = [(path, line, target, names) for path, module in _modules()
         for line, target, names in _imports(path, module)]


def test_the_walk_sees_the_lazy_imports():
    assert any(t == "tide._pool" for _, _, t, _ in CASES), "the pool import inside tide.fsdp was not found"


@pytest.mark.parametrize("path, line, target, names", CASES,
                         ids=[f"{os.path.relpath(p, PACKAGE)}:{ln}" for p, ln, _, _ in CASES])
def test_import_resolves(path, line, target, names):
    where = f"{os.path.relpath(path, PACKAGE)}:{line}"
    try:
        mod = importlib.import_module(target)
    except ModuleNotFoundError as e:
        pytest.fail(f"{where}: no module {target} ({e})")
    for name in names:
        if not hasattr(mod, name):
            try:
                importlib.import_module(f"{target}.{name}")
            except ModuleNotFoundError:
                pytest.fail(f"{where}: {target} has no {name}")
