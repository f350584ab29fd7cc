"""What a conformance run produces: one verdict per named check, with the evidence behind it.

A check is a behaviour with a name, a one-line reason and the rule it comes from. Its result is
PASS, FAIL or SKIP (the target was not given what the check needs, and the evidence says what).
The evidence is what was seen on the wire -- statuses, headers, body sizes and digests, effect
counts -- never a secret, a signature or a request header the caller passed in.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

from pgonce.core.frozen import refuse_changes

Verdict = Literal["PASS", "FAIL", "SKIP"]

#: The findings the check under way made (None outside one), so that a check stopped before it
#: returned (the server kept rate limiting it) still fails on the faults it had found.
_made: contextvars.ContextVar[list[Finding] | None] = contextvars.ContextVar(
    "conformance_findings", default=None
)


@refuse_changes
@dataclass(frozen=True, slots=True)
class Check:
    """A behaviour the kit checks: its name, why it matters, and where the rule comes from."""

    name: str
    why: str
    source: str


@refuse_changes
@dataclass(frozen=True, slots=True)
class Result:
    check: Check
    verdict: Verdict
    evidence: str


@dataclass(slots=True)
class Finding:
    """Evidence gathered by one check: what was seen, and which expectations failed."""

    seen: list[str] = field(default_factory=list)
    faults: list[str] = field(default_factory=list)
    skipped: str | None = None

    def __post_init__(self) -> None:
        made = _made.get()
        if made is not None:
            made.append(self)

    def saw(self, text: str) -> None:
        self.seen.append(text)

    def expect(self, ok: bool, fault: str) -> bool:
        """Record ``fault`` unless ``ok``; returns ``ok`` so a check can stop early."""
        if not ok:
            self.faults.append(fault)
        return ok

    def skip(self, reason: str) -> Finding:
        self.skipped = reason
        return self

    def result(self, check: Check) -> Result:
        if self.skipped is not None:
            return Result(check, "SKIP", self.skipped)
        if self.faults:
            return Result(check, "FAIL", "; ".join([*self.faults, *self.seen]))
        return Result(check, "PASS", "; ".join(self.seen))


@contextlib.contextmanager
def gathering() -> Iterator[list[Finding]]:
    """The findings made within (by a check, in any task it starts), in the order made."""
    made: list[Finding] = []
    token = _made.set(made)
    try:
        yield made
    finally:
        _made.reset(token)


@refuse_changes
@dataclass(frozen=True, slots=True)
class Report:
    """The results of one run against one target, in the order the checks ran."""

    kind: Literal["http", "webhooks"]
    target: str
    results: tuple[Result, ...]
    seconds: float

    @property
    def passed(self) -> bool:
        """No check failed (skipped checks do not fail a run; the table lists them)."""
        return all(r.verdict != "FAIL" for r in self.results)

    def counts(self) -> dict[Verdict, int]:
        found: dict[Verdict, int] = {"PASS": 0, "FAIL": 0, "SKIP": 0}
        for result in self.results:
            found[result.verdict] += 1
        return found

    def table(self, *, width: int = 100) -> str:
        """A plain-text table: verdict, check, evidence (wrapped), then the totals."""
        name_width = max((len(r.check.name) for r in self.results), default=5)
        room = max(30, width - name_width - 9)
        lines = [f"pgonce conformance {self.kind} {self.target}", ""]
        for result in self.results:
            chunks = _wrap(result.evidence, room) or [""]
            lines.append(f"{result.verdict:<5}  {result.check.name:<{name_width}}  {chunks[0]}")
            lines += [f"{'':<5}  {'':<{name_width}}  {chunk}" for chunk in chunks[1:]]
        counts = self.counts()
        lines += [
            "",
            f"{counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped "
            f"in {self.seconds:.1f} s",
        ]
        return "\n".join(lines)

    def as_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "target": self.target,
            "passed": self.passed,
            "seconds": round(self.seconds, 3),
            "counts": self.counts(),
            "checks": [
                {
                    "name": r.check.name,
                    "verdict": r.verdict,
                    "evidence": r.evidence,
                    "why": r.check.why,
                    "source": r.check.source,
                }
                for r in self.results
            ],
        }


def _wrap(text: str, width: int) -> list[str]:
    words = text.split(" ")
    lines: list[str] = []
    line = ""
    for word in words:
        if line and len(line) + 1 + len(word) > width:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}" if line else word
    if line:
        lines.append(line)
    return lines


def digest(body: bytes) -> str:
    """A short fingerprint of a body for the evidence: its size and the start of its SHA-256."""
    return f"{len(body)} B sha256:{hashlib.sha256(body).hexdigest()[:12]}"
