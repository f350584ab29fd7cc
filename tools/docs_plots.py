"""PNG plots of the benchmark tables in ``bench/results/latest.md``, for the Benchmarks page.

The tables are the data: each plot is drawn from a section of the latest results at build time,
so the page and the tables can never disagree. A section that is missing (the benchmarks were
rerun with fewer parts) yields no plot; the page shows what there is.
"""

from __future__ import annotations

import io
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

#: (file name, section title prefix, alt text) of each plot.
KEY_STORE = (
    ("keys-fresh.png", "Key store: fresh key (claim", "Key store, fresh key"),
    ("keys-duplicate.png", "Key store: duplicate", "Key store, duplicate (replay)"),
)
MIDDLEWARE = ("middleware.png", "Idempotency-Key middleware over HTTP", "The middleware over HTTP")


@dataclass(frozen=True)
class Table:
    title: str
    header: list[str]
    rows: list[dict[str, str]]


def tables(markdown: str) -> Iterator[Table]:
    """Every table under a ``## `` heading, as rows of ``{column: cell}``."""
    title = ""
    lines = markdown.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("## "):
            title = line[3:].strip()
        if line.startswith("|") and i + 1 < len(lines) and set(lines[i + 1]) <= set("|-: "):
            header = _cells(line)
            rows = []
            i += 2
            while i < len(lines) and lines[i].startswith("|"):
                rows.append(dict(zip(header, _cells(lines[i]), strict=False)))
                i += 1
            yield Table(title, header, rows)
            continue
        i += 1


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def _number(cell: str) -> float:
    return float(re.sub(r"[^0-9.]", "", cell) or "nan")


def _label(cell: str) -> str:
    return cell.replace("**", "")


def _png(draw: Callable[[object], None], width: float, height: float) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure = plt.figure(figsize=(width, height), dpi=110)
    try:
        draw(figure)
        figure.tight_layout()
        out = io.BytesIO()
        figure.savefig(out, format="png")
        return out.getvalue()
    finally:
        plt.close(figure)


def _by_concurrency(table: Table, caption: str) -> bytes:
    clients: dict[str, list[tuple[float, float, float]]] = {}
    for row in table.rows:
        point = (_number(row["conns"]), _number(row["tx/s"]), _number(row["p99 ms"]))
        clients.setdefault(_label(row["client"]), []).append(point)

    def draw(figure: object) -> None:
        throughput, p99 = figure.subplots(1, 2)  # type: ignore[attr-defined]
        for client, points in clients.items():
            points.sort()
            xs = [p[0] for p in points]
            style = {"linewidth": 2.5} if client.startswith("pgonce") else {"linestyle": "--"}
            throughput.plot(xs, [p[1] for p in points], marker="o", label=client, **style)
            p99.plot(xs, [p[2] for p in points], marker="o", label=client, **style)
        ticks = sorted({p[0] for points in clients.values() for p in points})
        for axes, what in ((throughput, "transactions/s"), (p99, "p99 latency, ms")):
            axes.set_xscale("log", base=2)
            axes.set_xticks(ticks, labels=[f"{t:g}" for t in ticks])
            axes.set_xlabel("connections")
            axes.set_ylabel(what)
            axes.grid(True, alpha=0.3)
        throughput.set_title(f"{caption}: throughput")
        p99.set_title(f"{caption}: p99")
        p99.legend(fontsize=7)

    return _png(draw, 11, 4.2)


def _variants(table: Table) -> bytes:
    rows = list(reversed(table.rows))
    names = [_label(r["variant"]) for r in rows]

    def draw(figure: object) -> None:
        throughput, p99 = figure.subplots(1, 2, sharey=True)  # type: ignore[attr-defined]
        colours = ["tab:blue" if n.startswith("pgonce") else "tab:gray" for n in names]
        throughput.barh(names, [_number(r["requests/s"]) for r in rows], color=colours)
        p99.barh(names, [_number(r["p99 ms"]) for r in rows], color=colours)
        throughput.set_xlabel("requests/s (higher is better)")
        p99.set_xlabel("p99 latency, ms (lower is better)")
        for axes in (throughput, p99):
            axes.grid(True, axis="x", alpha=0.3)
            axes.tick_params(axis="y", labelsize=8)

    return _png(draw, 11, 4.2)


def plots(markdown: str) -> list[tuple[str, str, bytes]]:
    """``(file name, alt text, PNG)`` of every plot the results allow."""
    found = list(tables(markdown))
    out: list[tuple[str, str, bytes]] = []
    for name, prefix, alt in KEY_STORE:
        table = next((t for t in found if t.title.startswith(prefix) and "conns" in t.header), None)
        if table is not None and "on PostgreSQL" not in table.title:
            out.append((name, alt, _by_concurrency(table, alt)))
    name, prefix, alt = MIDDLEWARE
    table = next((t for t in found if t.title.startswith(prefix) and "variant" in t.header), None)
    if table is not None:
        out.append((name, alt, _variants(table)))
    return out
