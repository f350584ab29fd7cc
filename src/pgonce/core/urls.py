"""URLs as pgonce shows them: never with a password."""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit


def public(url: str) -> str:
    """``url`` as a report or an error may show it: a password in its user part is replaced by
    ``***`` (httpx sends it as Basic credentials; a report is pasted into CI logs and tickets)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{parts.username}:***@{host}"))
