"""hiradix.envvars is the one table of environment variables and the only reader of them
in the package: every name the tree uses is registered, the package reads none directly,
and the getters parse values as the table documents."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from hiradix import envvars
from tests.support import REPO

NAME = re.compile(r"\bHIRADIX_[A-Z0-9_]*[A-Z0-9]\b")
#: HIRADIX_-prefixed words that are not environment variables: C header guards, and the
#: name of SGLang's pipeline tag (``P2PTag.HIRADIX_PP_SYNC``) that hiradix.sglang looks up.
NOT_VARIABLES = re.compile(r"HIRADIX_\w+_H|HIRADIX_PP_SYNC|HIRADIX_PATCHED")
SOURCES = ("*.py", "*.pyx", "*.pxi", "*.pxd", "*.h", "*.sh")


def _files(*folders: str) -> list[Path]:
    out: list[Path] = []
    for folder in folders:
        root = REPO / folder
        if root.is_file():
            out.append(root)
            continue
        for pattern in SOURCES:
            out.extend(root.rglob(pattern))
    return sorted(set(out))


def _names(files: list[Path]) -> dict[str, Path]:
    found: dict[str, Path] = {}
    for f in files:
        if f == Path(__file__).resolve():
            continue  # this file names unregistered variables on purpose
        for name in NAME.findall(f.read_text(encoding="utf-8", errors="replace")):
            if not NOT_VARIABLES.fullmatch(name):
                found.setdefault(name, f)
    return found


def test_every_name_in_the_tree_is_registered() -> None:
    files = _files("hiradix", "tests", "bench", "examples", "setup.py", ".ci/run")
    missing = {n: str(f.relative_to(REPO)) for n, f in _names(files).items() if n not in envvars._BY_NAME}
    assert not missing, f"register these in hiradix/envvars.py (name: first file): {missing}"


def test_the_package_reads_the_environment_only_through_envvars() -> None:
    offenders = []
    for f in _files("hiradix"):
        if f.name == "envvars.py" or f.suffix != ".py":
            continue
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "environb"):
                offenders.append(f"{f.relative_to(REPO)}:{node.lineno}")
    assert not offenders, f"read environment variables through hiradix.envvars: {offenders}"


def test_the_registry_reads_nothing_from_hiradix() -> None:
    """setup.py and the documentation build load it by path, without the package."""
    tree = ast.parse((REPO / "hiradix" / "envvars.py").read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            assert not (node.module or "").startswith("hiradix"), node.module
        elif isinstance(node, ast.Import):
            assert not any(a.name.startswith("hiradix") for a in node.names)


def test_entries_are_well_formed() -> None:
    names = [v.name for v in envvars.VARIABLES]
    assert len(names) == len(set(names))
    for v in envvars.VARIABLES:
        assert v.meaning.endswith(".") and v.read_in, v.name
        for where in v.read_in.split(","):
            assert (REPO / where.strip()).exists(), f"{v.name}: {where.strip()} does not exist"
            assert v.name in (REPO / where.strip()).read_text(encoding="utf-8"), f"{where.strip()} never names {v.name}"
        if v.kind == "flag":
            assert v.default in ("0", "1"), v.name
    with pytest.raises(ValueError, match="kind"):
        envvars.EnvVar("X", "bool", None, "runtime", "x.", "setup.py")


@pytest.mark.parametrize(
    ("value", "default_on", "default_off"),
    [(None, True, False), ("", True, False), ("0", False, False), ("1", True, True), ("yes", True, True)],
)
def test_flags_read_as_documented(value: str | None, default_on: bool, default_off: bool) -> None:
    env = {} if value is None else {"HIRADIX_PREFAULT": value, "HIRADIX_PUREPYTHON": value}
    assert envvars.flag("HIRADIX_PREFAULT", env) is default_on  # default 1
    assert envvars.flag("HIRADIX_PUREPYTHON", env) is default_off  # default 0


def test_text_and_path_read_as_documented() -> None:
    assert envvars.text("HIRADIX_CLUSTER_TOKEN", {"HIRADIX_CLUSTER_TOKEN": ""}) is None
    assert envvars.text("HIRADIX_CLUSTER_TOKEN", {"HIRADIX_CLUSTER_TOKEN": "s3cret"}) == "s3cret"
    assert envvars.text("HIRADIX_CUDA_ARCHS", {}) == "80;90;100"
    assert envvars.path("HIRADIX_TRACE", {}) is None
    assert envvars.path("HIRADIX_TRACE", {"HIRADIX_TRACE": "t.jsonl"}) == Path("t.jsonl")


def test_getters_refuse_unknown_names_and_wrong_kinds() -> None:
    with pytest.raises(KeyError, match="not registered"):
        envvars.flag("HIRADIX_NO_SUCH_SWITCH", {})
    with pytest.raises(TypeError, match="is a flag"):
        envvars.text("HIRADIX_PREFAULT", {})


def test_getters_read_the_process_environment_each_call(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HIRADIX_HUGEPAGES", "0")
    assert not envvars.flag("HIRADIX_HUGEPAGES")
    monkeypatch.delenv("HIRADIX_HUGEPAGES")
    assert envvars.flag("HIRADIX_HUGEPAGES")


def test_the_table_lists_every_variable_once() -> None:
    table = envvars.markdown_table()
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    assert [r.split("`")[1] for r in rows] == [
        v.name for s in envvars.SCOPES for v in envvars.VARIABLES if v.scope == s
    ]
    assert all(r.count(" | ") == 5 for r in rows)  # no stray "|" splits a cell
