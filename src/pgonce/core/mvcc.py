"""The MVCC horizon you can see: how old the oldest transaction that holds it back is.

Every claim, completion, done mark, relay mark and sweep leaves a dead row version behind, which
(auto)vacuum reclaims once no transaction can still see it. One transaction left open in the same
database -- an idle session in a transaction, a forgotten ``BEGIN`` in a console, a long report,
a prepared transaction, a replication slot -- pins that horizon: nothing dead after its start is
reclaimed, pgonce's tables and indexes grow, and their scans slow down until it ends. The health
check reads the oldest such transaction; ``pgonce doctor`` warns, and ``/metrics`` exports its age,
well before the bloat shows in the latency.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Literal

from pgonce.core.retention import Finding, format_duration

#: An open transaction older than this is reported: longer than any of pgonce's own (each is
#: a request, a batch or a sweep batch: seconds), and long enough that the dead rows a busy
#: pgonce leaves meanwhile are worth a look.
DEFAULT_HORIZON_WARN = timedelta(minutes=5)


@dataclass(frozen=True, slots=True)
class MvccHorizon:
    """What holds the database's MVCC horizon back, read at one moment."""

    #: Age of the oldest transaction holding an xid or a snapshot in this database (sessions and
    #: prepared transactions); None when there is none but the reader's own.
    oldest: timedelta | None
    #: pg_stat_activity's state of that session ("idle in transaction", "active", ...), or
    #: "prepared" for a prepared transaction.
    state: str | None
    #: Age in transaction ids of the oldest xmin anything holds: sessions, prepared transactions,
    #: replication slots (a slot of a stopped consumer pins the horizon with no session at all).
    xmin_age: int
    #: Whether this role sees every session (superuser, or pg_read_all_stats through pg_monitor);
    #: without it, other roles' transactions are invisible.
    sees_all: bool


def judge_mvcc_horizon(
    horizon: MvccHorizon, warn_after: timedelta = DEFAULT_HORIZON_WARN
) -> Finding:
    """The doctor's line: a warning when a transaction older than ``warn_after`` is open."""
    status: Literal["ok", "warn"] = "ok"
    detail = ""
    value = "none" if horizon.oldest is None else format_duration(horizon.oldest)
    if horizon.state:
        value += f" ({horizon.state})"
    if horizon.oldest is not None and horizon.oldest > warn_after:
        status = "warn"
        detail = (
            f"a transaction open for {format_duration(horizon.oldest)} ({horizon.state}) pins "
            "the MVCC horizon: no dead row of pgonce's tables younger than it can be reclaimed, "
            "so they and their indexes grow until it ends; end it, and set "
            "idle_in_transaction_session_timeout so that a forgotten one ends by itself"
        )
    elif not horizon.sees_all:
        status = "warn"
        detail = (
            "this role cannot see other roles' transactions: grant it pg_monitor (or "
            "pg_read_all_stats) so that a transaction pinning the MVCC horizon is seen"
        )
    return Finding(
        "oldest transaction",
        "database",
        None,
        status,
        value,
        f"none open longer than {format_duration(warn_after)}",
        detail,
    )
