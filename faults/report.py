"""The suite's results: one :class:`Result` per scenario, rendered as faults/results/latest.md.

A scenario passes when nothing acknowledged was lost, no effect happened twice, no answer was a
500 (a 503 with Retry-After is pgonce's documented answer while PostgreSQL is away, and is shown in
a column of its own), and every named check held.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from faults.load import Accounting


@dataclass
class Result:
    scenario: str
    load: str
    faults: str
    acc: Accounting = field(default_factory=Accounting)
    #: (what was checked, held?)
    checks: list[tuple[str, bool]] = field(default_factory=list)
    seconds: float = 0.0
    error: str | None = None

    def check(self, what: str, held: bool) -> bool:
        self.checks.append((what, held))
        return held

    @property
    def passed(self) -> bool:
        return (
            self.error is None
            and self.acc.lost == 0
            and self.acc.doubled == 0
            and self.acc.http_500 == 0
            and all(held for _, held in self.checks)
        )


def _statuses(acc: Accounting) -> str:
    return ", ".join(f"{status}: {n}" for status, n in sorted(acc.statuses.items())) or "none"


def render(results: list[Result], *, header: list[str], seconds: float) -> str:
    """The report: ``header`` (tools/provenance.py's lines, or a test's own), then the results."""
    failed = [r for r in results if not r.passed]
    lines = [
        *header,
        f"Took {seconds / 60:.1f} minutes. Everything runs on loopback against the real service "
        "processes and a PostgreSQL the suite starts itself (embedded, temporary data folder), "
        "restarted and cut by the suite; the broker is a redis-server the suite starts itself.",
        "",
        f"**{len(results) - len(failed)} of {len(results)} scenarios passed.**"
        + (f" Failing: {', '.join(r.scenario for r in failed)}." if failed else ""),
        "",
        "Columns: *sent* = distinct events, payments or outbox rows produced (for bad input: "
        "requests); *acked* = acknowledged to the producer (200, 201, committed; for bad input: "
        "distinct events or payments accepted); *effects* = distinct side effects "
        "found in the database or the broker; *lost* = acknowledged without an effect; "
        "*doubled* = effects beyond the first; *500* = answers 500 or another 5xx except 503; "
        "*503* = pgonce's documented 'retry later' answer while its database is away; "
        "*redelivered* = broker copies with a repeated message id (at-least-once publishing); "
        "every copy is run through pgonce's idempotent consumer, whose effects per message id "
        "are the outbox's *effects* and *doubled*, and each redelivered copy must be explained "
        "by an injected fault (its scenario's checks say how many were not).",
        "",
        "| scenario | faults injected | sent | acked | effects | lost | doubled | 500 | 503 "
        "| redelivered | result |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        a = r.acc
        lines.append(
            f"| {r.scenario} | {r.faults} | {a.sent} | {a.acknowledged} | {a.effects} | "
            f"{a.lost} | {a.doubled} | {a.http_500} | {a.http_503} | {a.redelivered} | "
            f"{'pass' if r.passed else '**FAIL**'} |"
        )
    lines.append("")
    for r in results:
        lines += section(r)
    lines += [
        "## Not covered",
        "",
        "- **Disk full**: not injected. Filling a filesystem needs a size-limited mount (tmpfs, a "
        "loop device), which needs privileges the suite should not assume; PostgreSQL answers a "
        "full disk with an error on the write, which reaches pgonce like the lost connections and "
        "failed transactions covered above.",
        "",
    ]
    return "\n".join(lines)


def section(r: Result) -> list[str]:
    """One scenario's part of the report: what ran, what was injected, every check."""
    lines = [
        f"## {r.scenario}",
        "",
        f"- **load**: {r.load}",
        f"- **faults**: {r.faults}",
        f"- **answers seen**: {_statuses(r.acc)}",
        f"- **time**: {r.seconds:.0f} s",
    ]
    if r.error:
        lines.append(f"- **error**: {r.error}")
    lines += [f"- {'✔' if held else '✘ **failed**'} {what}" for what, held in r.checks]
    lines += [f"- note: {note}" for note in r.acc.notes]
    lines.append("")
    return lines
