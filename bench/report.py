"""Tables of results, rendered as markdown."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Table:
    """One workload's results: a title, column names, rows of cells, and notes under the table."""

    title: str
    columns: list[str]
    rows: list[list[str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def add(self, *cells: object) -> None:
        self.rows.append([str(c) for c in cells])

    def markdown(self) -> str:
        lines = [f"## {self.title}", ""]
        lines.append("| " + " | ".join(self.columns) + " |")
        lines.append("|" + "|".join("---" for _ in self.columns) + "|")
        lines.extend("| " + " | ".join(row) + " |" for row in self.rows)
        if self.notes:
            lines.append("")
            lines.extend(self.notes)
        return "\n".join(lines) + "\n"


class Targets:
    """An issue's speed targets against one run's figures: each row says whether it was met.

    So every run reports the status itself, next to the figures it comes from, instead of
    leaving the reader to find the rows and do the arithmetic.
    """

    def __init__(self, title: str, note: str) -> None:
        self.table = Table(title, ["figure", "target", "measured", "met"], notes=[note])

    def at_least(self, figure: str, measured: float, target: float, unit: str = "%") -> None:
        self._add(figure, measured, target, unit, measured >= target, "≥")

    def at_most(self, figure: str, measured: float, target: float, unit: str = "%") -> None:
        self._add(figure, measured, target, unit, measured <= target, "≤")

    def _add(
        self, figure: str, measured: float, target: float, unit: str, met: bool, sign: str
    ) -> None:
        # One more digit where rounding would show a missed target as reached.
        digits = 1 if _spell(measured, unit) == _spell(target, unit) else 0
        self.table.add(
            figure,
            f"{sign} {_spell(target, unit)}",
            _spell(measured, unit, digits),
            "yes" if met else "no",
        )


def _spell(value: float, unit: str, digits: int = 0) -> str:
    if unit == "%":
        return f"{100 * value:.{digits}f} %"
    if unit == "×":
        return f"{value:.{2 + digits}f} ×"
    return f"{value:.{digits}f} {unit}"


def ratio(value: float, reference: float, name: str) -> str:
    """``NN % of <name>``: the one way figures are compared in this project."""
    if reference <= 0:
        return f"n/a (no {name} figure)"
    return f"{100 * value / reference:.0f} % of {name}"


def percentile(samples: list[float], p: float) -> float:
    """The p-th percentile (0-100) by nearest rank; 0 for no samples."""
    if not samples:
        return 0.0
    ordered = sorted(samples)
    rank = max(0, min(len(ordered) - 1, round(p / 100 * len(ordered) + 0.5) - 1))
    return ordered[rank]


def statements_alone(middleware: str, runs: str, reference: str, mine: str) -> str:
    """The note that says what a table's "key store's statements alone" variant is.

    ``middleware``: which kind it is; ``runs``: what it runs between the key store's begin() and
    commit(); ``reference`` and ``mine``: the rows on either side of it, the app without the key
    store and the app with pgonce's middleware.
    """
    return (
        f"The key store's statements alone: {middleware} with no logic of its own (no key "
        f"checks, scope, request fingerprint, size limits or expiry header) that runs {runs}. "
        f"Between it and {reference}: the claim and the stored response in the database; "
        f"between it and {mine}: the middleware's own Python."
    )
