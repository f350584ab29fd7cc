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

from pgonce.core.frozen import refuse_changes
from pgonce.core.retention import Finding, format_duration

#: An open transaction older than this is reported: longer than any of pgonce's own (each is
#: a request, a batch or a sweep batch: seconds), and long enough that the dead rows a busy
#: pgonce leaves meanwhile are worth a look.
DEFAULT_HORIZON_WARN = timedelta(minutes=5)

#: An xmin older than this many transaction ids is reported even when no open transaction is old:
#: what holds it has no session (a replication slot, a standby's feedback). A busy pgonce spends a
#: few hundred ids a second, so a stopped slot shows within the hour; a transaction of a few
#: minutes spans this many only where thousands of ids a second are spent.
DEFAULT_XMIN_AGE_WARN = 1_000_000


@refuse_changes
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
    #: The oldest transaction's session: its pid and application_name (None for a prepared
    #: transaction, which has no session).
    pid: int | None = None
    application_name: str | None = None
    #: The first 60 characters of that session's query, on one line (a query can carry values,
    #: so never more), or the gid of a prepared transaction.
    what: str | None = None
    #: The replication slot with the oldest xmin, and that xmin's age in transaction ids.
    slot: str | None = None
    slot_xmin_age: int = 0


def judge_mvcc_horizon(
    horizon: MvccHorizon,
    warn_after: timedelta = DEFAULT_HORIZON_WARN,
    xmin_warn: int = DEFAULT_XMIN_AGE_WARN,
) -> Finding:
    """The doctor's line: a warning when a transaction older than ``warn_after`` is open, or
    when something holds an xmin older than ``xmin_warn`` transaction ids (a replication slot
    has no session, so no age to show: only its xmin says it is there).

    The detail says where to find the cause and how to end it, which differs by kind: a session
    idle in a transaction is terminated, a running statement cancelled, a prepared transaction
    committed or rolled back by its id (no timeout ends it, and it survives restarts), a slot
    dropped.
    """
    status: Literal["ok", "warn"] = "ok"
    detail = ""
    value = "none" if horizon.oldest is None else format_duration(horizon.oldest)
    if horizon.state:
        value += f" ({horizon.state})"
    if horizon.oldest is not None and horizon.oldest > warn_after:
        status = "warn"
        detail = _pinned_by_transaction(horizon.oldest, horizon)
    elif horizon.xmin_age > xmin_warn:
        status = "warn"
        value += f", oldest xmin {horizon.xmin_age} transactions old"
        if horizon.slot is not None and horizon.slot_xmin_age >= horizon.xmin_age:
            slot = _quoted(horizon.slot)
            value += f" (slot {slot})"
            detail = (
                f"the replication slot {slot} holds an xmin {horizon.xmin_age} transactions old "
                f"and pins the MVCC horizon, so no dead row of pgonce's tables younger than it "
                "can be reclaimed: its consumer stopped or fell behind; see it in "
                "pg_replication_slots (active, xmin, catalog_xmin) and, if nobody consumes it, "
                f"drop it with SELECT pg_drop_replication_slot({slot})"
            )
        else:
            detail = (
                f"an xmin {horizon.xmin_age} transactions old pins the MVCC horizon, and no "
                f"transaction open longer than {format_duration(warn_after)} explains it: a "
                "replication slot whose consumer stopped (or a standby with hot_standby_feedback "
                "running a long query) holds it, so no dead row of pgonce's tables younger than it "
                "can be reclaimed; find the slot in pg_replication_slots (slot_name, active, xmin, "
                "catalog_xmin) and drop one that nobody consumes with "
                "pg_drop_replication_slot(slot_name)"
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


def _quoted(text: str) -> str:
    """``text`` as an SQL string literal, to paste into the statement the detail suggests."""
    return "'" + text.replace("'", "''") + "'"


def _holder(horizon: MvccHorizon) -> str:
    """Which session it is: pid, application_name and the start of its query, as far as known
    (a role that cannot see other roles' sessions reads no query)."""
    if horizon.pid is None:
        return ""
    text = f"pid {horizon.pid}"
    if horizon.application_name:
        text += f", application_name {_quoted(horizon.application_name)}"
    if horizon.what:
        text += f", query {horizon.what!r}"
    return text


def _pinned_by_transaction(age: timedelta, horizon: MvccHorizon) -> str:
    """What pins the horizon, where to find it, and how to end it, by the kind of transaction."""
    state = horizon.state
    holder = _holder(horizon)
    pins = (
        "pins the MVCC horizon: no dead row of pgonce's tables younger than it can be reclaimed, "
        "so they and their indexes grow until it ends"
    )
    if state == "prepared":
        gid = _quoted(horizon.what) if horizon.what else "'gid'"
        named = f" {gid}" if horizon.what else ""
        return (
            f"a prepared transaction{named} open for {format_duration(age)} {pins}; no timeout "
            "ends it and it survives a restart: see it in pg_prepared_xacts (gid, owner, "
            "prepared) and, once its transaction manager has given up on it, end it with "
            f"ROLLBACK PREPARED {gid} (or COMMIT PREPARED {gid})"
        )
    pid = str(horizon.pid) if horizon.pid is not None else "pid"
    if state is not None and not state.startswith("idle"):
        return (
            f"a statement running for {format_duration(age)} ({state}"
            f"{': ' + holder if holder else ''}) {pins}; see it in pg_stat_activity (pid, "
            "application_name, query, ordered by xact_start) and cancel it with "
            f"pg_cancel_backend({pid}) if it may stop; bound such work with statement_timeout, "
            "or give reports a replica"
        )
    return (
        f"a transaction open for {format_duration(age)} ({state}"
        f"{': ' + holder if holder else ''}) {pins}; see its session in pg_stat_activity (pid, "
        f"application_name, ordered by xact_start) and end it with pg_terminate_backend({pid}), "
        "and set idle_in_transaction_session_timeout so that a forgotten one ends by itself"
    )
