"""mkdocs hook: pages that are rendered from the repository rather than copied into docs/.

- Every ``bench/*.md`` becomes a page under ``benchmarks/`` (``bench/README.md`` as
  ``scripts.md``, ``bench/README_sglang.md`` as ``sglang-baselines.md``,
  ``bench/gpu/README.md`` as ``gpu.md``), with the images it shows, so the result tables
  the benchmark scripts' authors commit are the ones the site shows.
- ``<!-- envvars-table -->`` in a page is replaced by the table of
  :mod:`hiradix.envvars`, loaded by path (it imports nothing, so neither the package nor
  its compiled modules are needed to build the docs).
- ``<!-- bench-pages -->`` is replaced by a list of the benchmark pages and their titles.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench"
RENAMED = {"README.md": "scripts.md", "README_sglang.md": "sglang-baselines.md"}


def _envvars() -> Any:
    spec = importlib.util.spec_from_file_location("hiradix_envvars_for_docs", REPO / "hiradix" / "envvars.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it executes
    spec.loader.exec_module(module)
    return module


def _bench_sources() -> dict[str, Path]:
    """Page path under docs/ -> source file, for every bench page and the images they show."""
    out = {f"benchmarks/{RENAMED.get(p.name, p.name)}": p for p in sorted(BENCH.glob("*.md"))}
    out["benchmarks/gpu.md"] = BENCH / "gpu" / "README.md"
    out.update({f"benchmarks/{p.name}": p for p in sorted(BENCH.glob("*.png"))})
    return out


def on_files(files: Files, config: Any) -> Files:
    for uri, source in _bench_sources().items():
        files.append(File.generated(config, uri, abs_src_path=str(source)))
    return files


def _title(path: Path) -> str:
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("# "):
            return line[2:].strip()
    return path.stem


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    if "<!-- envvars-table -->" in markdown:
        markdown = markdown.replace("<!-- envvars-table -->", _envvars().markdown_table())
    if "<!-- bench-pages -->" in markdown:
        here = Path(page.file.src_uri).parent
        rows = [
            f"- [{_title(src)}]({Path(uri).relative_to(here).as_posix()}) (`{src.relative_to(REPO).as_posix()}`)"
            for uri, src in _bench_sources().items()
            if uri.endswith(".md")
        ]
        markdown = markdown.replace("<!-- bench-pages -->", "\n".join(rows))
    return markdown
