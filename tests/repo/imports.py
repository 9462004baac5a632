"""The import graph of a package, read from its source: what :mod:`tests.repo.test_layers`
checks.

Every file of the package counts: Python (``.py``, read with :mod:`ast`) and Cython
(``.pyx``, its ``.pxd`` and the ``.pxi`` files it ``include``\\ s, which belong to the
module that includes them; read as text, with comments and string literals blanked out, so
that a docstring's example is no import). An edge is any of:

- ``import hiradix.a.b`` and ``from hiradix.a import b`` (``cimport`` alike), at module level,
  inside a function or under ``TYPE_CHECKING``: a lazy or type-only import is still a
  dependency;
- the relative forms (``from . import x``, ``from ..a import b``), resolved against the
  importing module;
- ``import hiradix`` followed by ``hiradix.a.b.name`` in the code: an edge to the longest
  prefix that is a module (``hiradix.a.b``).

``from P import n`` names the module ``P.n`` where there is one, else ``P``. A name the
package root binds (``hiradix.page_hashes``, ``from hiradix import HiRadixTree``) resolves
to the module the root takes it from (``from hiradix.tree import *``: :mod:`hiradix.tree`);
what the root defines itself (``__version__``) resolves to the root, which every module
has loaded before its own first line runs (Python imports a package before its modules), so
it is no edge in the layer order. A module's parent packages, loaded by the same rule, are
no edges either. A string naming a module for a lookup at run time (a plugin registry) is
not an import.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

PYTHON = (".py",)
CYTHON = (".pyx", ".pxd", ".pxi")


@dataclass(frozen=True)
class Import:
    """One edge: ``source`` (a module) imports ``target`` (a module) at ``path:line``,
    taking ``names`` from it (``from target import names``; empty for the other forms)."""

    source: str
    target: str
    path: Path
    line: int
    names: tuple[str, ...] = ()


@dataclass(frozen=True)
class Use:
    """``<expr>._name`` (a private attribute of something that is not ``self``/``cls``) at
    ``path:line``, as the code spells it (``text``)."""

    name: str
    path: Path
    line: int
    text: str


@dataclass
class Module:
    """One module of the package and the files it is made of (``_core.pyx`` with
    ``_core.pxd`` and the ``.pxi`` files it includes)."""

    name: str
    files: list[Path] = field(default_factory=list)

    @property
    def is_package(self) -> bool:
        return any(p.stem == "__init__" for p in self.files)


# --- Cython, read as text --------------------------------------------------------------

_STRINGS = re.compile(
    r"""(?P<s>[rRbBuUfF]{0,2}(?:\"\"\"[\s\S]*?\"\"\"|'''[\s\S]*?'''|"(?:\\.|[^"\\\n])*"|'(?:\\.|[^'\\\n])*'))"""
    r"|(?P<c>\#[^\n]*)"
)
_INCLUDE = re.compile(r"""^[ \t]*include[ \t]+["']([^"']+)["']""", re.M)
_FROM = re.compile(r"^[ \t]*from[ \t]+(\.*[\w.]*)[ \t]+c?import[ \t]+(\([^)]*\)|[^\n]*)", re.M)
_IMPORT = re.compile(r"^[ \t]*c?import[ \t]+([^\n]*)", re.M)
_CHAIN = re.compile(r"(?<![\w.])hiradix(?:[ \t]*\.[ \t]*\w+)+")
_PRIVATE_USE = re.compile(r"(?<![\w.])(\w+)[ \t]*\.[ \t]*(_[A-Za-z]\w*)\b")
_PRIVATE_DEF = re.compile(r"^[ \t]*(?:async[ \t]+)?(?:cp?def|def)\b[^(\n=:]*?\b(_\w+)[ \t]*\(", re.M)


def blank(text: str) -> str:
    """``text`` with every comment and string literal emptied (``""``), line numbers kept."""

    def sub(m: re.Match[str]) -> str:
        if m.group("c"):
            return ""
        return '""' + "\n" * m.group("s").count("\n")

    return _STRINGS.sub(sub, text)


def _line(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


def _names(spec: str) -> list[tuple[str, str]]:
    """``a as b, c`` -> [("a", "b"), ("c", "c")] (parentheses and line breaks allowed)."""
    out = []
    for part in spec.strip().strip("()").replace("\\\n", " ").split(","):
        words = part.split()
        if not words:
            continue
        out.append((words[0], words[2] if len(words) >= 3 and words[1] == "as" else words[0]))
    return out


# --- the package -----------------------------------------------------------------------


class Package:
    """The modules of the package ``name`` under ``root`` and their imports."""

    def __init__(self, root: Path, name: str = "hiradix") -> None:
        self.root = root
        self.name = name
        self.modules: dict[str, Module] = {}
        base = root / name
        files = sorted(p for p in base.rglob("*") if p.suffix in PYTHON + CYTHON and "__pycache__" not in p.parts)
        includer = {}
        for p in files:
            if p.suffix == ".pyx":
                for m in _INCLUDE.finditer(p.read_text(encoding="utf-8")):
                    includer[(p.parent / m.group(1)).resolve()] = p
        for p in files:
            owner = includer.get(p.resolve(), p)
            self.modules.setdefault(self.dotted(owner), Module(self.dotted(owner))).files.append(p)
        self.stubs = {self.dotted(p) for p in base.rglob("*.pyi")}
        self._root_names: dict[str, str] | None = None

    def dotted(self, path: Path) -> str:
        parts = path.relative_to(self.root).with_suffix("").parts
        return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)

    def is_module(self, dotted: str) -> bool:
        return dotted in self.modules or dotted in self.stubs

    def unit(self, dotted: str) -> str:
        """The package a module belongs to in the layer order: ``hiradix.tree._core`` ->
        ``tree``, ``hiradix.cli`` -> ``cli``, the root ``hiradix`` -> ``__init__``."""
        parts = dotted.split(".")
        return parts[1] if len(parts) > 1 else "__init__"

    # resolution

    def root_names(self) -> dict[str, str]:
        """What the root binds, name -> the module it takes it from (itself for its own)."""
        if self._root_names is None:
            names: dict[str, str] = {}
            init = self.root / self.name / "__init__.py"
            tree = ast.parse(init.read_text(encoding="utf-8")) if init.exists() else ast.Module([], [])
            for node in tree.body:
                if isinstance(node, ast.ImportFrom):
                    src = self._absolute(self.name, True, node.level, node.module)
                    for a in node.names:
                        if a.name == "*":
                            names.setdefault("*", src)
                        else:
                            names[a.asname or a.name] = src
                elif isinstance(node, ast.Assign | ast.AnnAssign | ast.FunctionDef | ast.ClassDef):
                    targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", node)]
                    for t in targets:
                        if isinstance(t, ast.Name):
                            names[t.id] = self.name
                        elif isinstance(t, ast.FunctionDef | ast.ClassDef):
                            names[t.name] = self.name
            self._root_names = names
        return self._root_names

    def resolve(self, dotted: str) -> str:
        """The module a dotted name lives in: its longest prefix that is a module; a name
        the root binds, the module the root takes it from."""
        parts = dotted.split(".")
        for n in range(len(parts), 0, -1):
            prefix = ".".join(parts[:n])
            if self.is_module(prefix):
                if prefix == self.name and n < len(parts):
                    names = self.root_names()
                    return names.get(parts[1], names.get("*", self.name))
                return prefix
        return dotted

    def _absolute(self, source: str, is_package: bool, level: int, module: str | None) -> str:
        if level == 0:
            return module or ""
        base = source.split(".") if is_package else source.split(".")[:-1]
        base = base[: len(base) - (level - 1)] if level > 1 else base
        return ".".join([*base, module] if module else base)

    def _from(self, mod: Module, path: Path, line: int, level: int, module: str | None, names: Iterable[str]):
        target = self._absolute(mod.name, mod.is_package, level, module)
        if not (target == self.name or target.startswith(self.name + ".")):
            return
        rest = []
        for n in names:
            if n != "*" and self.is_module(f"{target}.{n}"):
                yield Import(mod.name, f"{target}.{n}", path, line, ())
            else:
                rest.append(n)
        if rest:
            if target == self.name:  # through the root, to where it takes each name from
                for n in rest:
                    yield Import(mod.name, self.resolve(f"{target}.{n}"), path, line, (n,))
            else:
                yield Import(mod.name, self.resolve(target), path, line, tuple(rest))

    def _import(self, mod: Module, path: Path, line: int, dotted: str):
        if dotted == self.name or dotted.startswith(self.name + "."):
            yield Import(mod.name, self.resolve(dotted), path, line, ())

    # reading

    def imports(self) -> Iterator[Import]:
        """Every edge of every module (see the module's docstring)."""
        for mod in self.modules.values():
            for path in mod.files:
                text = path.read_text(encoding="utf-8")
                if path.suffix in PYTHON:
                    yield from self._python_imports(mod, path, ast.parse(text, filename=str(path)))
                else:
                    yield from self._cython_imports(mod, path, blank(text))

    def _python_imports(self, mod: Module, path: Path, tree: ast.Module) -> Iterator[Import]:
        parent: dict[ast.AST, ast.AST] = {}
        bare = False  # the module binds the name ``hiradix`` (``import hiradix[.x]``)
        for node in ast.walk(tree):
            for child in ast.iter_child_nodes(node):
                parent[child] = node
            if isinstance(node, ast.Import):
                for a in node.names:
                    yield from self._import(mod, path, node.lineno, a.name)
                    bare |= a.asname is None and a.name.split(".")[0] == self.name
            elif isinstance(node, ast.ImportFrom):
                yield from self._from(mod, path, node.lineno, node.level, node.module, [a.name for a in node.names])
        if not bare:
            return
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute):
                continue
            up = parent.get(node)
            if isinstance(up, ast.Attribute) and up.value is node:
                continue  # not the whole chain
            chain = []
            cur: ast.AST = node
            while isinstance(cur, ast.Attribute):
                chain.append(cur.attr)
                cur = cur.value
            if isinstance(cur, ast.Name) and cur.id == self.name:
                dotted = ".".join([self.name, *reversed(chain)])
                yield Import(mod.name, self.resolve(dotted), path, node.lineno, ())

    def _cython_imports(self, mod: Module, path: Path, code: str) -> Iterator[Import]:
        spans = []
        for m in _FROM.finditer(code):
            spans.append(m.span())
            spec = m.group(1)
            level = len(spec) - len(spec.lstrip("."))
            names = [n for n, _ in _names(m.group(2))]
            yield from self._from(mod, path, _line(code, m.start()), level, spec[level:] or None, names)
        bare = False
        for m in _IMPORT.finditer(code):
            spans.append(m.span())
            for name, alias in _names(m.group(1)):
                yield from self._import(mod, path, _line(code, m.start()), name)
                bare |= alias == name and name.split(".")[0] == self.name
        if bare:
            for m in _CHAIN.finditer(code):
                if not any(a <= m.start() < b for a, b in spans):
                    yield Import(mod.name, self.resolve(re.sub(r"\s", "", m.group())), path, _line(code, m.start()))

    def private_definitions(self) -> dict[str, set[Path]]:
        """Each private function's name (``def _x``, ``cdef ... _x(``) -> the files that
        define one of that name."""
        out: dict[str, set[Path]] = {}
        for mod in self.modules.values():
            for path in mod.files:
                text = path.read_text(encoding="utf-8")
                if path.suffix in PYTHON:
                    for node in ast.walk(ast.parse(text)):
                        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                            out.setdefault(node.name, set()).add(path)
                else:
                    for m in _PRIVATE_DEF.finditer(blank(text)):
                        out.setdefault(m.group(1), set()).add(path)
        return {k: v for k, v in out.items() if k.startswith("_") and not k.startswith("__")}

    def private_uses(self) -> Iterator[Use]:
        """Every ``x._name`` where ``x`` is not ``self`` or ``cls``."""
        for mod in self.modules.values():
            for path in mod.files:
                text = path.read_text(encoding="utf-8")
                if path.suffix in PYTHON:
                    for node in ast.walk(ast.parse(text)):
                        if (
                            isinstance(node, ast.Attribute)
                            and node.attr.startswith("_")
                            and not node.attr.startswith("__")
                            and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
                        ):
                            yield Use(node.attr, path, node.lineno, ast.unparse(node))
                else:
                    code = blank(text)
                    for m in _PRIVATE_USE.finditer(code):
                        if m.group(1) not in ("self", "cls") and not m.group(2).startswith("__"):
                            yield Use(m.group(2), path, _line(code, m.start()), f"{m.group(1)}.{m.group(2)}")

    def module_of(self, path: Path) -> str:
        for mod in self.modules.values():
            if path in mod.files:
                return mod.name
        raise KeyError(path)


def cycles(edges: Iterable[tuple[str, str]]) -> list[list[str]]:
    """The strongly connected components of more than one node of a directed graph (each
    sorted; Tarjan's algorithm, iterative)."""
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        if a != b:
            graph.setdefault(a, set()).add(b)
            graph.setdefault(b, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on.add(start)
        while work:
            node, it = work[-1]
            nxt = next(it, None)
            if nxt is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == node:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
            elif nxt not in index:
                index[nxt] = low[nxt] = len(index)
                stack.append(nxt)
                on.add(nxt)
                work.append((nxt, iter(sorted(graph[nxt]))))
            elif nxt in on:
                low[node] = min(low[node], index[nxt])
    return sorted(out)
