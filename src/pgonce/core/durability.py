"""Durability you can see: whether the primary has the synchronous standby it is configured for.

With ``synchronous_standby_names`` set, a commit is acknowledged only once a standby has it too;
that is what lets a failover lose nothing that was answered. When no standby is attached in sync
(after a failover, until the old node returns; a standby down or lagging), the server either waits
(every commit hangs) or, under an HA manager that clears the setting, runs on one copy of the
data. Both deserve a line in ``/readyz``, ``/metrics`` and ``pgonce doctor``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pgonce.core.frozen import refuse_changes
from pgonce.core.retention import Finding

#: "not configured": synchronous_standby_names is empty (nothing to report on); "synchronous": at
#: least one standby is in sync (or in a quorum); "none": configured, but none is; "unknown": the
#: role may not read the standbys' state (it needs pg_read_all_stats, e.g. through pg_monitor).
SyncState = Literal["not configured", "synchronous", "none", "unknown"]


@refuse_changes
@dataclass(frozen=True, slots=True)
class Durability:
    """What the server says about its synchronous standbys, read at one moment."""

    #: synchronous_standby_names is set.
    configured: bool
    #: Standbys attached now in sync or quorum state.
    synchronous: int
    #: Standbys attached now whose state this role cannot see.
    unknown: int
    #: The server takes no writes: a standby (what a failover makes of the old primary, or where
    #: a DSN without ``target_session_attrs=read-write`` landed) or
    #: ``default_transaction_read_only``. No claim succeeds there.
    read_only: bool = False

    @property
    def state(self) -> SyncState:
        if not self.configured:
            return "not configured"
        if self.synchronous:
            return "synchronous"
        return "unknown" if self.unknown else "none"


#: What a server that takes no writes is told in ``/readyz``, ``pgonce doctor`` and a claim's error.
READ_ONLY_DETAIL = (
    "the server takes no writes (a standby, such as an old primary after a failover, or "
    "default_transaction_read_only): list every node in the DSN with "
    "target_session_attrs=read-write, or point it at the primary"
)


def judge_durability(durability: Durability) -> Finding:
    """The doctor's line: a failure on a server that takes no writes; a warning when a
    synchronous standby is configured but not attached."""
    if durability.read_only:
        return Finding(
            "sync standby", "database", None, "fail", "read-only", "the primary", READ_ONLY_DETAIL
        )
    state = durability.state
    detail = ""
    status: Literal["ok", "warn"] = "ok"
    if state == "none":
        status = "warn"
        detail = (
            "synchronous_standby_names is set but no standby is attached in sync: commits wait "
            "for one, or (where an HA manager relaxed the setting) a crash of this server now "
            "loses what was acknowledged since; bring the standby back"
        )
    elif state == "unknown":
        status = "warn"
        detail = (
            "this role cannot read the standbys' sync_state: grant it pg_monitor (or "
            "pg_read_all_stats) so that a missing synchronous standby is seen"
        )
    value = state if state != "synchronous" else f"{durability.synchronous} in sync"
    return Finding(
        "sync standby", "database", None, status, value, "one in sync when configured", detail
    )
