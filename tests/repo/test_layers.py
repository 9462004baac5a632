"""The package graph is a DAG in one stated order, and private names stay in their module.

The layers of :mod:`hiradix`, lowest first. A module may import its own package and any
package of a *lower* layer, never a higher one nor a sibling in the same layer (siblings
are independent: the tree knows no memory pool, the simulator no SGLang). Every import
counts, also one inside a function or under ``TYPE_CHECKING``: a lazy import is still a
dependency. A plugin registry may *name* a higher module as a string (the storage
registry's built-in ``peer`` backend): that is a lookup at run time, not an import. The
same order is written in docs/architecture.md.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

from tests.support import REPO as ROOT

PACKAGE = ROOT / "hiradix"

LAYERS: list[tuple[str, ...]] = [
    # the one reader of environment variables (imports nothing of hiradix: setup.py and
    # the documentation build load it by path)
    ("envvars",),
    # helpers of the whole package: the compiled/twin switch, settings, ports, namespaces
    ("_native", "settings", "_ports", "_netns", "_sglang_versions"),
    # the radix tree; KV memory (pools, allocator, copy engines); authenticated connections
    ("tree", "memory", "net"),
    # the L3 storage seam and its local backends; one-sided read transports
    ("storage", "transport"),
    # the tiered cache: tree + memory + storage
    ("cache",),
    # the peer cache: an L3 backend over the transports and the RPC directory
    ("peer",),
    # the consumers: SGLang's drop-in, the simulator
    ("sglang", "sim"),
    # entry points: the command line, SGLang's plugin hook, the package's own __init__
    ("cli", "_sglang_plugin", "__init__"),
]
RANK = {name: rank for rank, names in enumerate(LAYERS) for name in names}


def modules() -> Iterator[tuple[str, Path]]:
    """(dotted name, path) of every Python and Cython module of the package."""
    for path in sorted(PACKAGE.rglob("*")):
        if path.suffix in (".py", ".pyx") and "__pycache__" not in path.parts:
            parts = path.relative_to(ROOT).with_suffix("").parts
            yield ".".join(parts), path


def unit(module: str) -> str:
    """The package a module belongs to in the layer order: ``hiradix.tree._core`` ->
    ``tree``, ``hiradix.cli`` -> ``cli``, ``hiradix.__init__`` -> ``__init__``."""
    return module.split(".")[1]


_CYTHON_IMPORT = re.compile(r"^\s*(?:from\s+(hiradix(?:\.\w+)*)\s+c?import|c?import\s+(hiradix(?:\.\w+)*))", re.M)


def imports(path: Path) -> Iterator[tuple[int, str, list[str]]]:
    """(line, module imported, names imported from it) for every ``hiradix`` import."""
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".pyx":  # not Python: the import lines are enough
        for m in _CYTHON_IMPORT.finditer(text):
            yield text.count("\n", 0, m.start()) + 1, m.group(1) or m.group(2), []
        return
    for node in ast.walk(ast.parse(text, filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("hiradix"):
                    yield node.lineno, alias.name, []
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("hiradix"):
            yield node.lineno, str(node.module), [a.name for a in node.names]


def is_module(dotted: str) -> bool:
    base = ROOT.joinpath(*dotted.split("."))
    return base.is_dir() or any(base.with_suffix(s).exists() for s in (".py", ".pyx", ".pyi"))


def test_every_package_has_a_place_in_the_layer_order() -> None:
    found = {unit(name) for name, _ in modules()}
    assert not found - set(RANK), f"not in LAYERS: {sorted(found - set(RANK))}"


def test_no_import_goes_up_or_sideways_in_the_layer_order() -> None:
    bad = []
    for name, path in modules():
        mine = unit(name)
        for line, target, names in imports(path):
            targets = [target] if target != "hiradix" else [f"hiradix.{n}" for n in names]
            for dotted in targets:
                if dotted == "hiradix" or "." not in dotted:
                    continue
                theirs = unit(dotted)
                if theirs == mine or theirs not in RANK:
                    continue
                if RANK[theirs] >= RANK[mine]:
                    rel = path.relative_to(ROOT)
                    bad.append(f"{rel}:{line}: {mine} (layer {RANK[mine]}) imports {dotted} (layer {RANK[theirs]})")
    order = " < ".join("{" + ", ".join(names) + "}" for names in LAYERS)
    assert not bad, f"imports against the layer order {order}:\n" + "\n".join(bad)


def test_no_private_name_is_imported_from_another_module() -> None:
    # ``from hiradix.x.y import _name``: a private module (``_core``, ``_native``,
    # ``_reference``) is fine to import; a private function, class or variable is its
    # module's own business.
    bad = []
    for _, path in modules():
        if path.suffix != ".py":
            continue
        for line, target, names in imports(path):
            for n in names:
                if n.startswith("_") and not n.startswith("__") and not is_module(f"{target}.{n}"):
                    bad.append(f"{path.relative_to(ROOT)}:{line}: from {target} import {n}")
    assert not bad, "private names imported across modules:\n" + "\n".join(bad)


def test_no_private_function_is_called_from_another_module() -> None:
    # ``obj._name`` where ``_name`` is a function or method defined only in *other* modules
    # of the package (``self._x`` / ``cls._x`` are the module's own; so is any ``_name``
    # the module itself defines).
    defined: dict[str, set[Path]] = {}
    trees = {path: ast.parse(path.read_text(encoding="utf-8")) for _, path in modules() if path.suffix == ".py"}
    for path, tree in trees.items():
        for node in ast.walk(tree):
            private = isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name.startswith("_")
            if private and not node.name.startswith("__"):
                defined.setdefault(node.name, set()).add(path)
    bad = []
    for path, tree in trees.items():
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and node.attr in defined and path not in defined[node.attr]):
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            owners = ", ".join(sorted(str(p.relative_to(ROOT)) for p in defined[node.attr]))
            bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)} (defined in {owners})")
    assert not bad, "private functions used across modules:\n" + "\n".join(bad)


def test_the_documentation_states_the_order() -> None:
    order = " < ".join("{" + ", ".join(names) + "}" for names in LAYERS)
    assert order in (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8"), order
