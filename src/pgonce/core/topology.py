"""What stands between pgonce and PostgreSQL, judged for ``pgonce doctor``.

A transaction-mode pooler hands each transaction whichever server session is free, so session
state does not survive between transactions: prepared statements (pgonce sends its own unnamed
there) and LISTEN, which receives nothing through it. The inbox workers and the relay then find
new rows by polling, unless a direct connection is given for LISTEN.
"""

from __future__ import annotations

from pgonce.core.retention import Finding


def judge_listen(
    polling_cost: str, *, pooled: bool, listen_given: bool, listen_pooled: bool
) -> Finding:
    """The doctor's line on LISTEN: ``pooled`` says the DSN goes through a transaction-mode
    pooler; ``listen_given`` that a listen DSN is configured, ``listen_pooled`` that it does too.
    ``polling_cost`` says what polling costs, in words."""
    limit = "LISTEN on a direct connection"
    if listen_given and listen_pooled:
        return Finding(
            "listen", "database", None, "warn", "listen_dsn is pooled too", limit,
            "listen_dsn also shares server sessions: " + polling_cost,
        )  # fmt: skip
    if pooled and not listen_given:
        return Finding(
            "listen", "database", None, "warn", "through a transaction pooler", limit,
            "LISTEN through a transaction-mode pooler receives nothing: " + polling_cost,
        )  # fmt: skip
    value = "listen_dsn, direct" if listen_given else "direct"
    return Finding("listen", "database", None, "ok", value, limit, "")
