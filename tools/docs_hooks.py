"""MkDocs hooks: the reference tables and the benchmark plots, generated at build time.

- A line ``<!-- pgonce:NAME -->`` in a page becomes ``docs_reference.GENERATORS[NAME]()``: the
  configuration, CLI, metrics and problem-type references come from the code that defines them.
- ``<!-- pgonce:plots -->`` becomes the PNG plots of ``bench/results/latest.md``
  (``docs_plots``), added to the site as generated files.
- ``<!-- pgonce:capacity -->`` becomes the capacity figures of that report (``docs_capacity``).

An unknown marker fails the build, so a typo cannot publish an empty reference.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

# MkDocs loads this file by its path: the repository's root makes ``tools`` importable.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tools import docs_capacity, docs_plots, docs_reference

MARKER = re.compile(r"^<!-- pgonce:([a-z-]+) -->$", re.MULTILINE)
BENCH = docs_reference.ROOT / "bench" / "results" / "latest.md"
PLOTS_DIR = "img/bench"

_plots: list[tuple[str, str, bytes]] = []


def on_files(files: Any, config: Any) -> Any:
    from mkdocs.structure.files import File

    _plots.clear()
    if BENCH.exists():
        _plots.extend(docs_plots.plots(BENCH.read_text()))
    for name, _alt, png in _plots:
        files.append(File.generated(config, f"{PLOTS_DIR}/{name}", content=png))
    return files


def _plots_markdown(page_path: str) -> str:
    depth = page_path.count("/")
    prefix = "../" * depth
    return "\n\n".join(f"![{alt}]({prefix}{PLOTS_DIR}/{name})" for name, alt, _ in _plots)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    def replace(match: re.Match[str]) -> str:
        name = match.group(1)
        if name == "plots":
            return _plots_markdown(page.file.src_uri)
        if name == "capacity":
            return docs_capacity.capacity()
        if name not in docs_reference.GENERATORS:
            raise ValueError(f"{page.file.src_uri}: unknown generated section {name!r}")
        return docs_reference.GENERATORS[name]()

    return MARKER.sub(replace, markdown)
