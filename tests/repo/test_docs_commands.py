"""Every command the documentation shows parses as printed.

The ```bash (and ```sh) blocks of ``README.md``, ``docs/**/*.md`` and ``bench/*.md`` (the
benchmark pages the site includes) are read command by command (continuation lines joined,
``&&``/``;``/``|``/``&`` split, leading ``VAR=value`` assignments dropped), and each one
hiradix owns is checked without running it:

- ``hiradix ...`` (any path ending in ``hiradix``) and ``python -m hiradix.cli ...``: the
  arguments go through :func:`hiradix.cli.build_parser` (``python -m hiradix.peer.cli``:
  the peer parser), so an unknown option, a missing value or a value the option's type
  refuses fails, naming the file and line;
- ``python bench/X.py ...`` and ``python examples/X.py ...``: the script exists, and is run
  in one helper process up to its ``parse_args`` call, which parses the arguments shown and
  stops it there (a script that shows arguments must parse them with argparse);
- ``python -m pytest PATH ...``: every test path shown exists.

Anything else (pip, git, export, SGLang's own server, .ci/run) is not hiradix's to check.
README's relative links, and every repository path a document names in backticks, are
checked to exist as well.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support import REPO

FENCE_OPEN = re.compile(r"^\s*```(bash|sh|shell)\s*$")
FENCE_CLOSE = re.compile(r"^\s*```\s*$")
SEPARATORS = {"&&", "||", ";", "|", "&", ";;", "|&"}
ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
PYTHON = re.compile(r"^python(3(\.\d+)?)?$")


@dataclass(frozen=True)
class Command:
    file: str
    line: int
    argv: tuple[str, ...]

    def where(self) -> str:
        return f"{self.file}:{self.line}: {shlex.join(self.argv)}"


def _documents() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md")), *sorted((REPO / "bench").glob("*.md"))]


def _split(text: str) -> list[str] | None:
    """Shell tokens of ``text`` (operators as tokens of their own), or None while a quote is open."""
    lexer = shlex.shlex(text, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    lexer.commenters = "#"
    try:
        return list(lexer)
    except ValueError:  # no closing quotation: the command goes on on the next line
        return None


def _logical_lines(path: Path) -> list[tuple[int, str, list[str] | None]]:
    """(first line number, text, tokens) of each command inside a bash fence: continuation
    lines joined, and lines inside an open quote too, as the shell reads them. ``tokens`` is
    None for a command whose quotes never close."""
    out: list[tuple[int, str, list[str] | None]] = []
    inside = False
    start, text = 0, ""
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not inside:
            inside = bool(FENCE_OPEN.match(line))
            continue
        if FENCE_CLOSE.match(line):
            if text:
                out.append((start, text, None))
            inside, text = False, ""
            continue
        if not text:
            start = number
        if line.rstrip().endswith("\\"):
            text += line.rstrip()[:-1] + " "
            continue
        text += line
        tokens = _split(text)
        if tokens is None:
            text += "\n"
            continue
        out.append((start, text, tokens))
        text = ""
    return out


def _commands(path: Path, root: Path = REPO) -> list[Command]:
    rel = path.relative_to(root).as_posix()
    found: list[Command] = []
    for number, text, tokens in _logical_lines(path):
        if tokens is None:
            found.append(Command(rel, number, ("<unbalanced quotes>", text)))
            continue
        segment: list[str] = []
        for token in [*tokens, ";"]:
            if token in SEPARATORS:
                while segment and ASSIGNMENT.match(segment[0]):
                    segment.pop(0)
                if segment:
                    found.append(Command(rel, number, tuple(segment)))
                segment = []
            else:
                segment.append(token)
    return found


def _all_commands() -> list[Command]:
    return [c for doc in _documents() for c in _commands(doc)]


def _kind(cmd: Command) -> tuple[str, list[str]] | None:
    """What to check and with which arguments, or None when the command is not hiradix's."""
    argv = list(cmd.argv)
    head = Path(argv[0]).name
    if head == "hiradix":
        return "cli", argv[1:]
    if not PYTHON.match(head) or len(argv) < 2:
        return None
    if argv[1] == "-m" and len(argv) > 2:
        module = argv[2]
        if module == "hiradix.cli":
            return "cli", argv[3:]
        if module == "hiradix.peer.cli":
            return "peer-cli", argv[3:]
        if module == "pytest":
            return "pytest", argv[3:]
        if module.startswith("hiradix"):
            return "module", [module]
        return None
    script = argv[1]
    if script.startswith(("bench/", "examples/")) and script.endswith(".py"):
        return "script", argv[1:]
    return None


def _parse(parser_factory: object, args: list[str]) -> str | None:
    """None if ``args`` parse (``--help`` counts), else what argparse said."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            parser_factory().parse_args(args)  # type: ignore[operator]
    except SystemExit as exc:
        if exc.code not in (0, None):
            return err.getvalue().strip().splitlines()[-1] if err.getvalue().strip() else f"exit {exc.code}"
    return None


# Run each script up to its parse_args (in one process: imports are shared) and stop it there.
_SCRIPT_DRIVER = r"""
import argparse, contextlib, io, json, runpy, sys
class Parsed(BaseException):
    pass
_orig = argparse.ArgumentParser.parse_args
def _parse_and_stop(self, args=None, namespace=None):
    _orig(self, args, namespace)
    raise Parsed
argparse.ArgumentParser.parse_args = _parse_and_stop
import os
repo, hiradix_dir = os.getcwd(), os.path.join(os.getcwd(), "hiradix")
base_path = list(sys.path[1:])
results = []
for argv in json.loads(sys.argv[1]):
    # As `python SCRIPT` would: the script's folder first on the path, and none of the
    # previous script's own modules (bench/ and tests/ both have a workload.py) left behind.
    for name, module in list(sys.modules.items()):
        f = getattr(module, "__file__", None) or ""
        # (not the venv's packages: CI's .venv sits inside the checkout, and numpy or torch
        # imported a second time in one process crashes it)
        if f.startswith(repo) and not f.startswith(hiradix_dir) and not f.startswith(sys.prefix):
            del sys.modules[name]
    sys.path[:] = [os.path.dirname(os.path.abspath(argv[0])), *base_path]
    sys.argv = list(argv)
    err = io.StringIO()
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            runpy.run_path(argv[0], run_name="__main__")
        results.append("the script ended without parsing its arguments with argparse")
    except Parsed:
        results.append(None)
    except SystemExit as exc:
        text = err.getvalue().strip()
        results.append(None if exc.code in (0, None) else (text.splitlines()[-1] if text else f"exit {exc.code}"))
    except BaseException as exc:
        results.append(f"{type(exc).__name__}: {exc}")
print(json.dumps(results))
"""


COMMANDS = _all_commands()
CHECKED = [(c, k) for c in COMMANDS if (k := _kind(c)) is not None]


def test_every_command_can_be_split() -> None:
    broken = [f"{c.file}:{c.line}: {c.argv[1]}" for c in COMMANDS if c.argv[0] == "<unbalanced quotes>"]
    assert not broken, "unbalanced quotes in a bash block:\n" + "\n".join(broken)


def test_the_documents_show_commands_to_check() -> None:
    kinds = {k[0] for _, k in CHECKED}
    assert {"cli", "script", "pytest"} <= kinds, kinds
    assert any(c.file == "README.md" for c, _ in CHECKED)


def test_hiradix_commands_parse_as_printed() -> None:
    from hiradix import cli
    from hiradix.peer import cli as peer_cli

    factories = {"cli": cli.build_parser, "peer-cli": peer_cli.build_parser}
    failures = []
    for cmd, (kind, args) in CHECKED:
        if kind in factories:
            error = _parse(factories[kind], args)
            if error:
                failures.append(f"{cmd.where()}\n    {error}")
    assert not failures, "commands in the documentation do not parse:\n" + "\n".join(failures)


def test_modules_and_test_paths_exist() -> None:
    import importlib.util

    failures = []
    for cmd, (kind, args) in CHECKED:
        if kind == "module" and importlib.util.find_spec(args[0]) is None:
            failures.append(f"{cmd.where()}\n    no module {args[0]}")
        if kind == "pytest":
            for arg in args:
                looks_like_path = not arg.startswith("-") and ("/" in arg or arg.endswith(".py"))
                if looks_like_path and not (REPO / arg.split("::")[0]).exists():
                    failures.append(f"{cmd.where()}\n    no such test path: {arg}")
    assert not failures, "\n".join(failures)


@pytest.mark.slow  # imports every benchmark script in a subprocess: 10 to 20 s
def test_scripts_parse_their_arguments_as_printed() -> None:
    scripts = [(cmd, args) for cmd, (kind, args) in CHECKED if kind == "script"]
    failures = [f"{cmd.where()}\n    no such script" for cmd, args in scripts if not (REPO / args[0]).is_file()]
    runnable = [(cmd, args) for cmd, args in scripts if (REPO / args[0]).is_file()]
    for cmd, args in runnable:
        if len(args) > 1 and "parse_args" not in (REPO / args[0]).read_text(encoding="utf-8"):
            failures.append(f"{cmd.where()}\n    shows arguments, but the script parses none with argparse")
    unique = sorted({tuple(args) for _, args in runnable if "parse_args" in (REPO / args[0]).read_text()})
    if unique:
        proc = subprocess.run(
            [sys.executable, "-c", _SCRIPT_DRIVER, json.dumps(unique)],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        verdicts = dict(zip(unique, json.loads(proc.stdout.strip().splitlines()[-1]), strict=True))
        for cmd, args in runnable:
            verdict = verdicts.get(tuple(args))
            if verdict:
                failures.append(f"{cmd.where()}\n    {verdict}")
    assert not failures, "commands in the documentation do not parse:\n" + "\n".join(failures)


def test_readme_links_point_at_files() -> None:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    broken = []
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if "://" not in target and not (REPO / target).exists():
            broken.append(target)
    assert not broken, f"README.md links to missing files: {broken}"


def test_repository_paths_named_in_the_documents_exist() -> None:
    """A file or folder of the repository named in backticks (`hiradix/cli.py`,
    `tests/e2e`, `bench/RESULTS_sim.md`) exists, so moved code leaves no stale pointers."""
    named = re.compile(r"`((?:hiradix|tests|bench|examples|requirements|\.ci|docs)/[^`\s*{<]*)`")
    missing = []
    for doc in _documents():
        for number, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1):
            for path in named.findall(line):
                if not (REPO / path.rstrip("/").split("::")[0]).exists():
                    missing.append(f"{doc.relative_to(REPO)}:{number}: {path}")
    assert not missing, "the documents name paths that do not exist:\n" + "\n".join(missing)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("hiradix sim --gpu h200 # comment", [("hiradix", "sim", "--gpu", "h200")]),
        ("A=1 B=2 .venv/bin/hiradix plan && kill %1", [(".venv/bin/hiradix", "plan"), ("kill", "%1")]),
        ("x & y", [("x",), ("y",)]),
    ],
)
def test_the_splitter(tmp_path: Path, text: str, expected: list[tuple[str, ...]]) -> None:
    doc = tmp_path / "d.md"
    doc.write_text(f"intro\n```bash\n{text}\n```\n")
    commands = [c.argv for c in _commands(doc, tmp_path)]
    assert commands == expected


def test_a_wrong_option_is_caught() -> None:
    from hiradix import cli

    assert _parse(cli.build_parser, ["sim", "--no-such-option"]) is not None
    assert _parse(cli.build_parser, ["plan", "--target-hit-rate", "lots"]) is not None
    assert _parse(cli.build_parser, ["sim", "--help"]) is None
