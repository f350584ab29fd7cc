"""The LISTEN/NOTIFY channels that wake pgonce's loops (inbox workers, outbox relays)."""

from __future__ import annotations


def notify_channel(schema: str, table: str) -> str:
    """``<schema>.<table>``: the channel that wakes the loops serving ``table`` in ``schema``.

    Cut to 63 bytes, the longest identifier PostgreSQL keeps (schema names are ASCII, see
    :class:`pgonce.config.Settings`). Notifications are sent with ``pg_notify(text, ...)`` and
    received with ``LISTEN`` on the quoted identifier, so the dot needs no care.
    """
    return f"{schema}.{table}"[:63]
