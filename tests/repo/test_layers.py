"""The package graph is a DAG in one stated order, and private names stay in their module.

The layers of :mod:`hiradix`, lowest first. A module may import its own package and any
package of a *lower* layer, never a higher one nor a sibling in the same layer (siblings
are independent: the tree knows no memory pool, the simulator no SGLang). Inside one
package the modules' imports form no cycle. Every import counts, in Python and Cython
files alike, also one inside a function, a relative one or one under ``TYPE_CHECKING``: a
lazy or type-only import is still a dependency (what counts as an import:
:mod:`tests.repo.imports`). A plugin registry may *name* a higher module as a string (the
storage registry's built-in ``peer`` backend): that is a lookup at run time, not an import.
The same order is written in docs/architecture.md.

Each rule is checked on the package and, with a violation planted in a small package
written to a temporary folder, seen to fail.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.repo.imports import Package, cycles
from tests.support import REPO as ROOT

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


# --- the rules: each returns what breaks it, one line each --------------------------------


def unplaced(pkg: Package) -> list[str]:
    """Packages (and top-level modules) that have no place in :data:`LAYERS`."""
    return sorted({pkg.unit(name) for name in pkg.modules} - set(RANK))


def against_the_order(pkg: Package) -> list[str]:
    """Imports of a package of the same or a higher layer (the root excepted: see
    :mod:`tests.repo.imports`)."""
    bad = []
    for e in pkg.imports():
        mine, theirs = pkg.unit(e.source), pkg.unit(e.target)
        if e.target == pkg.name or theirs == mine or theirs not in RANK or mine not in RANK:
            continue
        if RANK[theirs] >= RANK[mine]:
            rel = e.path.relative_to(pkg.root)
            bad.append(f"{rel}:{e.line}: {mine} (layer {RANK[mine]}) imports {e.target} (layer {RANK[theirs]})")
    return bad


def cycles_inside_a_package(pkg: Package) -> list[str]:
    """Each cycle among the modules of one package, with the imports that close it."""
    edges = [e for e in pkg.imports() if pkg.unit(e.source) == pkg.unit(e.target) and e.target != pkg.name]
    bad = []
    for comp in cycles((e.source, e.target) for e in edges):
        where = sorted(
            {
                f"{e.path.relative_to(pkg.root)}:{e.line} -> {e.target}"
                for e in edges
                if {e.source, e.target} <= set(comp)
            }
        )
        bad.append(" <-> ".join(comp) + " (" + "; ".join(where) + ")")
    return bad


def private_names_imported(pkg: Package) -> list[str]:
    """``from m import _name`` where ``m._name`` is no module: a private module (``_core``,
    ``_native``, ``_reference``) is fine to import; a private function, class or variable is
    its module's own business."""
    return [
        f"{e.path.relative_to(pkg.root)}:{e.line}: from {e.target} import {n}"
        for e in pkg.imports()
        for n in e.names
        if n.startswith("_") and not n.startswith("__")
    ]


def private_functions_called(pkg: Package) -> list[str]:
    """``obj._name`` where ``_name`` is a function or method (``def``, ``cdef``, ``cpdef``)
    defined only in *other* modules of the package (``self._x`` / ``cls._x`` are the
    module's own; so is any ``_name`` the module itself defines)."""
    owners = {name: {pkg.module_of(p) for p in paths} for name, paths in pkg.private_definitions().items()}
    bad = []
    for use in pkg.private_uses():
        if use.name in owners and pkg.module_of(use.path) not in owners[use.name]:
            where = ", ".join(sorted(owners[use.name]))
            bad.append(f"{use.path.relative_to(pkg.root)}:{use.line}: {use.text} (defined in {where})")
    return bad


# --- the package ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def package() -> Package:
    return Package(ROOT)


def test_every_package_has_a_place_in_the_layer_order(package: Package) -> None:
    assert not unplaced(package), f"not in LAYERS: {unplaced(package)}"


def test_no_import_goes_up_or_sideways_in_the_layer_order(package: Package) -> None:
    order = " < ".join("{" + ", ".join(names) + "}" for names in LAYERS)
    bad = against_the_order(package)
    assert not bad, f"imports against the layer order {order}:\n" + "\n".join(bad)


def test_no_cycle_inside_a_package(package: Package) -> None:
    bad = cycles_inside_a_package(package)
    assert not bad, "import cycles inside a package:\n" + "\n".join(bad)


def test_no_private_name_is_imported_from_another_module(package: Package) -> None:
    bad = private_names_imported(package)
    assert not bad, "private names imported across modules:\n" + "\n".join(bad)


def test_no_private_function_is_called_from_another_module(package: Package) -> None:
    bad = private_functions_called(package)
    assert not bad, "private functions used across modules:\n" + "\n".join(bad)


def test_the_checker_reads_every_kind_of_file(package: Package) -> None:
    # the compiled tree's includes belong to it, and its imports are read
    core = package.modules["hiradix.tree._core"]
    assert {p.suffix for p in core.files} == {".pyx", ".pxd", ".pxi"}
    targets = {e.target for e in package.imports() if e.source == "hiradix.tree._core"}
    assert "hiradix.tree._results" in targets


def test_the_documentation_states_the_order() -> None:
    order = " < ".join("{" + ", ".join(names) + "}" for names in LAYERS)
    assert order in (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8"), order


# --- planted violations: each rule fails on one ---------------------------------------------

# A small package in the same layers: the root re-exports the tree; the cache sits above it.
BASE = {
    "hiradix/__init__.py": "from hiradix.tree import *\n__version__ = '0'\n",
    "hiradix/tree/__init__.py": "from hiradix.tree.a import A\n__all__ = ['A']\n",
    "hiradix/tree/a.py": "A = 1\n\ndef _helper():\n    return 1\n",
    "hiradix/tree/b.py": "import hiradix\n\nB = hiradix.A + hiradix.tree.a.A + int(hiradix.__version__)\n",
    "hiradix/tree/_core.pyx": 'include "_core_x.pxi"\nfrom hiradix.tree.a import A\n',
    "hiradix/tree/_core_x.pxi": "cdef int _cdef_helper(int x):\n    return x\n",
    "hiradix/cache/__init__.py": "",
    "hiradix/cache/cache.py": (
        "from typing import TYPE_CHECKING\n\nfrom hiradix.tree import a\nfrom ..tree.b import B\n\n"
        "if TYPE_CHECKING:\n    from hiradix.cache.stats import S\n\nX = a.A + B\n"
    ),
    "hiradix/cache/stats.py": "S = 1\n",
}


def plant(tmp_path: Path, files: dict[str, str]) -> Package:
    for rel, text in {**BASE, **files}.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return Package(tmp_path)


def test_the_planted_package_passes_as_written(tmp_path: Path) -> None:
    pkg = plant(tmp_path, {})
    assert not unplaced(pkg)
    assert not against_the_order(pkg)
    assert not cycles_inside_a_package(pkg)
    assert not private_names_imported(pkg)
    assert not private_functions_called(pkg)


def test_a_package_outside_the_order_fails(tmp_path: Path) -> None:
    assert unplaced(plant(tmp_path, {"hiradix/extra/__init__.py": ""})) == ["extra"]


UPWARD = {
    "absolute": ("hiradix/tree/c.py", "from hiradix.cache import cache\n"),
    "absolute, a module's name": ("hiradix/tree/c.py", "from hiradix.cache.cache import X\n"),
    "plain import": ("hiradix/tree/c.py", "import hiradix.cache.cache as c\n"),
    "relative": ("hiradix/tree/c.py", "from ..cache import cache\n"),
    "relative, from a package": ("hiradix/tree/__init__.py", "from ..cache.cache import X\n"),
    "in a function": ("hiradix/tree/c.py", "def f():\n    from hiradix.cache.cache import X\n    return X\n"),
    "type-only": (
        "hiradix/tree/c.py",
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from hiradix.cache.cache import X\n",
    ),
    "import hiradix + attribute": (
        "hiradix/tree/c.py",
        "import hiradix\n\n\ndef f():\n    return hiradix.cache.cache.X\n",
    ),
    "import hiradix.x + attribute": ("hiradix/tree/c.py", "import hiradix.tree\n\nY = hiradix.cache.cache.X\n"),
    "through the root": ("hiradix/tree/c.py", "from hiradix import X\n"),
    "through the root, attribute": ("hiradix/tree/c.py", "import hiradix\n\nY = hiradix.X\n"),
    "pyx": ("hiradix/tree/_c.pyx", "from hiradix.cache import cache\n"),
    "pyx, cimport": ("hiradix/tree/_c.pyx", "from hiradix.cache.cache cimport X\n"),
    "pyx, relative": ("hiradix/tree/_c.pyx", "from ..cache.cache import X\n"),
    "pyx, parenthesized": ("hiradix/tree/_c.pyx", "from hiradix.cache.cache import (\n    X,\n)\n"),
    "pyx, import hiradix + attribute": (
        "hiradix/tree/_c.pyx",
        "import hiradix\n\ndef f():\n    return hiradix.cache.cache.X\n",
    ),
    "pxd": ("hiradix/tree/_core.pxd", "from hiradix.cache.cache cimport X\n"),
    "pxi": ("hiradix/tree/_core_x.pxi", "from hiradix.cache.cache import X\n"),
    "sideways": ("hiradix/memory/m.py", "from hiradix.tree import a\nfrom hiradix.net import n\n"),
}


@pytest.mark.parametrize("form", list(UPWARD))
def test_an_upward_import_fails_in_every_form(tmp_path: Path, form: str) -> None:
    rel, text = UPWARD[form]
    files = {rel: text, "hiradix/memory/__init__.py": "", "hiradix/net/__init__.py": "", "hiradix/net/n.py": ""}
    if form == "through the root" or form.startswith("through the root,"):
        files["hiradix/__init__.py"] = BASE["hiradix/__init__.py"] + "from hiradix.cache.cache import X\n"
    bad = against_the_order(plant(tmp_path, files))
    line = rel.split("/")[-1]
    assert bad and all(line in b for b in bad), bad


def test_the_root_and_a_string_are_no_import(tmp_path: Path) -> None:
    # the root's own names, a docstring's example and a registry's string name no module
    text = (
        '"""Example::\n\n    from hiradix.cache import cache\n"""\nimport hiradix\n\n'
        "V = hiradix.__version__  # hiradix.cache.cache\nNAME = 'hiradix.cache.cache'\n"
    )
    pyx = '"""from hiradix.cache import cache"""\n# from hiradix.cache import cache\nS = "hiradix.cache.cache"\n'
    assert not against_the_order(plant(tmp_path, {"hiradix/tree/c.py": text, "hiradix/tree/_c.pyx": pyx}))


CYCLES = {
    "runtime": {"hiradix/cache/stats.py": "from hiradix.cache.cache import X\nS = 1\n"},
    "in a function": {"hiradix/cache/stats.py": "def f():\n    from hiradix.cache import cache\n    return cache\n"},
    "relative": {"hiradix/cache/stats.py": "from .cache import X\n"},
    "attribute": {"hiradix/cache/stats.py": "import hiradix\n\n\ndef f():\n    return hiradix.cache.cache.X\n"},
    "three modules": {
        "hiradix/cache/stats.py": "from hiradix.cache.l3 import L\n",
        "hiradix/cache/l3.py": "from hiradix.cache.cache import X\nL = 1\n",
    },
    "a package and its module": {
        "hiradix/cache/__init__.py": "from hiradix.cache.stats import S\n",
        "hiradix/cache/stats.py": "from hiradix.cache import OTHER\nS = 1\n",
    },
    "pyx": {"hiradix/tree/a.py": "from hiradix.tree._core import f\nA = 1\n"},
    "pxi": {
        "hiradix/tree/_core_x.pxi": "from hiradix.tree.b import B\n",
        "hiradix/tree/b.py": "from hiradix.tree import _core\n",
    },
}


@pytest.mark.parametrize("form", list(CYCLES))
def test_a_cycle_inside_a_package_fails(tmp_path: Path, form: str) -> None:
    # the cache's import of stats is type-only: a cycle all the same
    assert cycles_inside_a_package(plant(tmp_path, CYCLES[form]))


PRIVATE_IMPORTS = {
    "py": ("hiradix/cache/c.py", "from hiradix.tree.a import _helper\n"),
    "py, relative": ("hiradix/tree/c.py", "from .a import _helper\n"),
    "py, through the root": ("hiradix/cache/c.py", "from hiradix import _helper\n"),
    "pyx": ("hiradix/cache/_c.pyx", "from hiradix.tree.a import _helper\n"),
    "pyx, cimport": ("hiradix/cache/_c.pyx", "from hiradix.tree._core cimport _cdef_helper\n"),
    "pxi": ("hiradix/tree/_core_x.pxi", "from hiradix.tree.a import A, _helper\n"),
}


@pytest.mark.parametrize("form", list(PRIVATE_IMPORTS))
def test_a_private_name_imported_fails(tmp_path: Path, form: str) -> None:
    rel, text = PRIVATE_IMPORTS[form]
    bad = private_names_imported(plant(tmp_path, {rel: text}))
    assert len(bad) == 1 and "_helper" in bad[0], bad


def test_a_private_module_is_fine_to_import(tmp_path: Path) -> None:
    files = {"hiradix/cache/c.py": "from hiradix.tree import _core\nfrom hiradix.tree._core import A\n"}
    assert not private_names_imported(plant(tmp_path, files))


PRIVATE_CALLS = {
    "py": ("hiradix/cache/c.py", "from hiradix.tree import a\n\nY = a._helper()\n"),
    "py, a cdef function": ("hiradix/cache/c.py", "def f(core):\n    return core._cdef_helper(1)\n"),
    "pyx": ("hiradix/cache/_c.pyx", "def f(core):\n    return core._helper()\n"),
    "pyx, a cdef function": ("hiradix/cache/_c.pyx", "def f(core):\n    if core:\n        core._cdef_helper(1)\n"),
    "pxi": ("hiradix/tree/_core_x.pxi", "cdef int g(obj):\n    return obj._helper()\n"),
}


@pytest.mark.parametrize("form", list(PRIVATE_CALLS))
def test_a_private_function_called_fails(tmp_path: Path, form: str) -> None:
    rel, text = PRIVATE_CALLS[form]
    bad = private_functions_called(plant(tmp_path, {rel: text}))
    assert len(bad) == 1 and "_helper" in bad[0], bad


def test_a_private_function_of_ones_own_is_fine(tmp_path: Path) -> None:
    # self._x and a name the module defines itself (the .pyx and its includes are one module)
    files = {
        "hiradix/tree/_core.pyx": 'include "_core_x.pxi"\n\ndef f(o):\n    return o._cdef_helper(1)\n',
        "hiradix/cache/c.py": "class C:\n    def _helper(self):\n        return self._helper()\n\n\nY = C()._helper()",
    }
    assert not private_functions_called(plant(tmp_path, files))
