"""The repository's own hygiene: one ruff version everywhere, no paths of one machine's
layout, CI steps that cannot hide a failed install."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.support import REPO as ROOT

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib


# Absolute paths that belong to one machine's layout (a home, a workplace, a mount), not to
# the project. Results files record the commands as they ran, with their machine; they are
# the one place such a path may be quoted, and they say which machine it was.
MACHINE_PATH = re.compile(r"(?<![\w.~$/-])/(?:work|home|root|Users|mnt|scratch)/[\w.-]")
RECORDS = re.compile(r"^bench/RESULTS_[\w.-]+\.md$")


def tracked_text_files() -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"not a git checkout ({exc}): the tracked files cannot be listed")
    return [name for name in out.decode().split("\0") if name]


def test_ruff_is_pinned_once_for_ci_and_pre_commit() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = [d for d in project["optional-dependencies"]["dev"] if d.startswith("ruff")]
    assert len(pins) == 1 and pins[0].startswith("ruff=="), f"ruff must be pinned exactly in [dev]: {pins}"
    version = pins[0].removeprefix("ruff==")
    hook = re.search(
        r"repo: https://github.com/astral-sh/ruff-pre-commit\s+rev: v?([\w.]+)",
        (ROOT / ".pre-commit-config.yaml").read_text(),
    )
    assert hook is not None, "no ruff-pre-commit hook in .pre-commit-config.yaml"
    assert hook.group(1) == version, f"pre-commit runs ruff {hook.group(1)}, pyproject.toml pins {version}"


def test_no_absolute_path_of_one_machine_in_the_repository() -> None:
    found = []
    for name in tracked_text_files():
        if RECORDS.match(name):
            continue
        path = ROOT / name
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, FileNotFoundError, IsADirectoryError):
            continue  # binary (a PNG), or deleted in the working tree
        for number, line in enumerate(text.splitlines(), 1):
            if MACHINE_PATH.search(line):
                found.append(f"{name}:{number}: {line.strip()[:120]}")
    assert not found, "absolute paths of one machine's layout:\n" + "\n".join(found)


def test_the_machine_path_pattern_catches_what_it_is_for() -> None:
    root = "/"  # joined here, so that this file does not hold what it looks for
    assert MACHINE_PATH.search(f'default=Path("{root}work/shared/traces/x.jsonl")')
    assert MACHINE_PATH.search(f"PYTHONPATH={root}home/me/hiradix/tests/stubs")
    assert not MACHINE_PATH.search("see ../shared/traces/ or ~/.cache/hiradix/l3")
    assert not MACHINE_PATH.search("https://example.org/work/x and /tmp/x and /usr/include/infiniband")


def test_ci_runs_setup_lint_and_test_in_order_and_hides_no_failure() -> None:
    run = (ROOT / ".ci" / "run").read_text()
    steps = re.findall(r"^\.ci/(\w+)$", run, flags=re.MULTILINE)
    assert steps == ["setup", "lint", "test"], steps
    for script in ("run", "setup", "lint", "test", "wheel"):
        text = (ROOT / ".ci" / script).read_text()
        assert text.startswith("#!/usr/bin/env bash\n") and "set -euo pipefail" in text, script
        code = "\n".join(line.split("#", 1)[0] for line in text.splitlines())
        assert "|| true" not in code, f".ci/{script} has a `|| true` that can hide a failure"


def _readme_block(marker: str) -> str:
    """The first command of README.md's bash blocks that contains ``marker``."""
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    lines = [line for block in blocks for line in block.splitlines() if marker in line]
    assert lines, f"README.md shows no command with {marker!r}"
    return lines[0]


def test_lint_builds_the_docs_with_the_command_readme_prints() -> None:
    # README: `pip install -r requirements/docs.txt && mkdocs build --strict`; .ci/lint runs
    # the build part as printed (.ci/setup installs requirements/docs.txt).
    build = _readme_block("mkdocs build").split("&&")[-1].strip()
    assert build == ".venv/bin/mkdocs build --strict", build
    lint = [line.strip() for line in (ROOT / ".ci" / "lint").read_text().splitlines()]
    assert build in lint, f".ci/lint does not run README's {build!r}"
    assert not any("mkdocs" in line and line != build for line in lint if not line.startswith("#")), lint


def test_the_simulators_plots_and_bars_are_an_extra_the_main_job_installs() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = {re.split(r"[<>=;\[ ]", d, maxsplit=1)[0] for d in project["dependencies"]}
    assert not names & {"tqdm", "matplotlib"}, "an SGLang server's install must pull neither"
    sim = {re.split(r"[<>=;\[ ]", d, maxsplit=1)[0] for d in project["optional-dependencies"]["sim"]}
    assert sim == {"tqdm", "matplotlib"}
    assert '-e ".[sim]"' in _readme_block("hiradix sim")
    assert re.search(r'-e "\.\[[\w,]*\bsim\b[\w,]*\]"', (ROOT / ".ci" / "setup").read_text())
