"""What every workload gets: the database, and helpers to make scratch databases on it."""

from __future__ import annotations

from dataclasses import dataclass

import psycopg

from pgonce.store.migrate import migrate


@dataclass
class BenchContext:
    dsn: str
    schema: str
    #: Short runs for a smoke test: figures are not meaningful, the code paths are exercised.
    quick: bool = False

    def prepare(self) -> None:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            migrate(conn, self.schema)

    def seconds(self, normal: float) -> float:
        """How long one measurement runs: ``normal`` seconds, or a fraction in a quick run."""
        return min(normal, 1.0) if self.quick else normal
