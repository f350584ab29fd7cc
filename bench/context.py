"""What every workload gets: the database, the run's profile, and helpers for scratch databases."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

import psycopg

from pgonce.store.migrate import migrate

T = TypeVar("T")

#: The profiles a run can have; ``make bench`` states its profile in the report's header.
PROFILES = {
    "standard": "every measurement at its full length and number of rounds",
    "short": "measurements 0.4 × as long, fewer rounds and rows (stated in each table's notes), "
    "for a quicker full run",
    "quick": "a smoke test: figures are not meaningful, the code paths are exercised",
}
#: How much shorter a measurement of the short profile is than the standard one.
SHORT_SCALE = 0.4


@dataclass
class BenchContext:
    dsn: str
    schema: str
    profile: str = "standard"

    @property
    def quick(self) -> bool:
        """Short runs for a smoke test: figures are not meaningful, the code paths are exercised."""
        return self.profile == "quick"

    def prepare(self) -> None:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            migrate(conn, self.schema)

    def seconds(self, normal: float) -> float:
        """How long one measurement runs: ``normal`` seconds, shorter in the short and quick
        profiles."""
        if self.profile == "quick":
            return min(normal, 1.0)
        return normal * SHORT_SCALE if self.profile == "short" else normal

    def pick(self, standard: T, *, short: T, quick: T) -> T:
        """A size (rounds, rows, levels) by the run's profile."""
        return {"standard": standard, "short": short, "quick": quick}[self.profile]
