"""The convention for compiled modules (``hiradix._native``): each ``.pyx`` is listed in
``TWINS`` with a twin that imports and a parity test that names it, ``setup.py`` builds
exactly those, the documentation's table (docs/architecture.md) is that list, and ``load`` is the one switch."""

from __future__ import annotations

import ast
import importlib
import importlib.util
from pathlib import Path

import pytest

from hiradix import _native
from hiradix._native import TWINS
from tests.support import REPO


def _dotted(pyx: Path) -> str:
    return ".".join(pyx.relative_to(REPO).with_suffix("").parts)


def _resolve(dotted: str) -> object:
    """A module, or an attribute path inside one (``pkg.mod.Class.method``)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            target: object = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            target = getattr(target, attr)
        return target
    raise ModuleNotFoundError(dotted)


def _setup_modules() -> set[str]:
    tree = ast.parse((REPO / "setup.py").read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Tuple) and len(node.elts) == 2 and isinstance(node.elts[0], ast.Constant):
            first = node.elts[0].value
            if isinstance(first, str) and first.startswith("hiradix."):
                names.add(first)
    return names


def test_every_compiled_module_is_listed_and_built() -> None:
    listed = {t.compiled for t in TWINS}
    sources = {_dotted(p) for p in (REPO / "hiradix").rglob("*.pyx")}
    assert sources == listed, "a .pyx without a TWINS entry, or an entry without its .pyx"
    assert _setup_modules() == listed, "setup.py builds other modules than TWINS lists"
    assert len(listed) == len(TWINS)


@pytest.mark.parametrize("twin", TWINS, ids=lambda t: t.compiled)
def test_twin_imports_and_parity_test_names_the_module(twin: _native.Twin) -> None:
    if twin.twin is not None:
        if twin.twin.startswith("hiradix.sglang.") and importlib.util.find_spec("sglang") is None:
            pytest.skip("hiradix.sglang's twin needs SGLang, which is not installed")
        assert _resolve(twin.twin) is not None
    else:
        assert twin.note, "a module without a twin says why"
    test = REPO / twin.parity_test
    assert test.is_file(), twin.parity_test
    stem = twin.compiled.rpartition(".")[2].split("_")[-1]  # "core", "gather", "emu", ...
    assert f"_{stem}" in test.read_text(), f"{twin.parity_test} does not use {twin.compiled}"


def test_docs_table_is_the_list() -> None:
    readme = (REPO / "docs" / "architecture.md").read_text()
    for t in TWINS:
        twin = f"`{t.twin}`" if t.twin else "(none)"
        assert f"| `{t.compiled}` | {twin} | `{t.parity_test}` |" in readme, t.compiled


def test_load_is_the_one_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="not a compiled module"):
        _native.load("hiradix.no_such._module")
    monkeypatch.setenv("HIRADIX_PUREPYTHON", "1")
    assert all(_native.load(t.compiled) is None for t in TWINS)
    monkeypatch.setenv("HIRADIX_PUREPYTHON", "0")
    assert not _native.pure_python()
