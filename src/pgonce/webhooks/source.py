"""A webhook source: everything the inbox needs to know about one provider endpoint.

The receiver looks a source up by the name in ``POST /webhooks/{source}``; the workers look up its
handler and its retry, ordering and out-of-order policies. A source is immutable: configuration is
read once, at start, and checked there (:class:`~pgonce.errors.ConfigError`).
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from psycopg import AsyncConnection

from pgonce.core.checks import describe
from pgonce.core.inbox import (
    HeadFailurePolicy,
    InboxEvent,
    Ordering,
    OutOfOrderPolicy,
    RetryPolicy,
)
from pgonce.errors import ConfigError
from pgonce.webhooks.schemes.base import Headers, Scheme, fallback_event_id

#: A handler runs once per event, in the transaction that marks the event done, and writes through
#: ``conn`` so its writes commit with that mark. It must not commit or roll back itself; raising
#: rolls its writes back and schedules a retry.
Handler = Callable[[InboxEvent, AsyncConnection[Any]], Awaitable[None]]

#: Reads the ordering key (and optionally a version) of a delivery from its parsed JSON (``None``
#: when the source does not require JSON) and its headers; ``None`` means "not ordered".
OrderingExtractor = Callable[[Any, Headers], Ordering | None]

#: Reads the event type (``"invoice.paid"``) from the parsed JSON and the headers, to pick a handler
#: from :attr:`Source.handlers`; ``None`` when the event has none.
EventTypeExtractor = Callable[[Any, Headers], str | None]

#: Names the event id of a delivery whose scheme finds none; see :func:`fallback_event_id`.
EventIdFallback = Callable[[Headers, bytes], str]


def body_hash_event_id(headers: Headers, body: bytes) -> str:
    """The default fallback: the hash of the body (see :func:`fallback_event_id`)."""
    return fallback_event_id(body)


#: Bodies larger than this are refused with 413 before they are read to the end. Providers' events
#: are a few kilobytes; 1 MiB leaves room for large ones while a flood of huge bodies cannot fill
#: memory. GitHub sends up to 25 MB: raise it for such sources.
DEFAULT_BODY_LIMIT = 1024 * 1024

#: A handler that has not finished after this long is cancelled and counts as failed: its
#: transaction holds row locks, and a hung handler must not hold them forever.
DEFAULT_HANDLER_TIMEOUT = timedelta(seconds=30)

_SOURCE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$")


@dataclass(frozen=True)
class Source:
    """One configured webhook source.

    - ``name``: the ``{source}`` in the URL and the inbox rows' ``source``.
    - ``scheme``: verifies signatures and names event ids (:mod:`pgonce.webhooks.schemes`).
    - ``handler``: the application's code for each event; ``None`` for a receive-only source
      (its events wait until a worker with a handler runs).
    - ``handlers`` and ``event_type``: handlers by event type, chosen with the ``event_type``
      extractor; ``handler`` then serves the types not listed, and an event that neither names
      is marked done without running anything.
    - ``body_limit``: bytes; a longer body is answered 413.
    - ``json_required``: refuse bodies that are not UTF-8 JSON with 400 (handlers then get
      ``event.payload``).
    - ``event_id_fallback``: the id when the scheme finds none (default: the body's SHA-256).
    - ``ordering``: the ordering extractor; ``None`` processes events in any order.
    - ``out_of_order``: ``"process"`` every event, or ``"drop"`` those whose version is older than
      the last applied one for their ordering key (recorded as ``skipped``).
    - ``head_failure``: when the oldest event of an ordering key is dead-lettered, ``"block"`` keeps
      the rest of that key waiting until it is replayed (strict order); ``"park"`` lets them flow.
    - ``retry``: attempts and backoff; ``handler_timeout``: see :data:`DEFAULT_HANDLER_TIMEOUT`.
    """

    name: str
    scheme: Scheme
    handler: Handler | None = None
    handlers: Mapping[str, Handler] = field(default_factory=dict)
    event_type: EventTypeExtractor | None = None
    body_limit: int = DEFAULT_BODY_LIMIT
    json_required: bool = True
    event_id_fallback: EventIdFallback = body_hash_event_id
    ordering: OrderingExtractor | None = None
    out_of_order: OutOfOrderPolicy = "process"
    head_failure: HeadFailurePolicy = "block"
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    handler_timeout: timedelta = DEFAULT_HANDLER_TIMEOUT

    def __post_init__(self) -> None:
        # Types first: a wrong one would fail far from here (a comparison at the first
        # delivery, the retry policy's attributes at the first failure), untyped.
        if not isinstance(self.name, str):
            raise ConfigError(f"a webhook source's name must be a str, not {describe(self.name)}")
        if not callable(getattr(self.scheme, "verify", None)) or not callable(
            getattr(self.scheme, "event_id", None)
        ):
            raise ConfigError(
                f"source {self.name!r}: scheme must be a signature scheme, not "
                f"{describe(self.scheme)}: build one with build_scheme(name, secrets)"
            )
        if not isinstance(self.json_required, bool):
            # "false" or 0 from a configuration would be read as true, or the reverse, silently.
            raise ConfigError(
                f"source {self.name!r}: json_required must be True or False, not "
                f"{describe(self.json_required)}"
            )
        if isinstance(self.body_limit, bool) or not isinstance(self.body_limit, int):
            raise ConfigError(
                f"source {self.name!r}: body_limit must be a whole number of bytes, not "
                f"{describe(self.body_limit)}"
            )
        if not isinstance(self.handler_timeout, timedelta):
            raise ConfigError(
                f"source {self.name!r}: handler_timeout must be a datetime.timedelta, not "
                f"{describe(self.handler_timeout)}"
            )
        if not isinstance(self.retry, RetryPolicy):
            raise ConfigError(
                f"source {self.name!r}: retry must be a RetryPolicy, not "
                f"{describe(self.retry)}: RetryPolicy(attempts=..., base=..., cap=...)"
            )
        if self.handler is not None and not callable(self.handler):
            raise ConfigError(
                f"source {self.name!r}: handler must be callable, not {describe(self.handler)}"
            )
        for option in ("ordering", "event_type", "event_id_fallback"):
            extractor = getattr(self, option)
            if extractor is not None and not callable(extractor):
                raise ConfigError(
                    f"source {self.name!r}: {option} must be callable, not {describe(extractor)}"
                    " (a function of the delivery, not the name of a field)"
                )
        if not isinstance(self.handlers, Mapping):
            raise ConfigError(
                f"source {self.name!r}: handlers must map event types to handlers, not "
                f"{describe(self.handlers)}"
            )
        for kind, chosen in self.handlers.items():
            if not callable(chosen):
                raise ConfigError(
                    f"source {self.name!r}: the handler of event type {kind!r} must be "
                    f"callable, not {describe(chosen)}"
                )
        if not _SOURCE_NAME.match(self.name):
            raise ConfigError(
                f"webhook source name {self.name!r} is not allowed: use letters, digits, '_', '.' "
                "and '-', starting with a letter or digit, at most 100 characters"
            )
        if self.body_limit < 1:
            raise ConfigError(f"source {self.name!r}: body_limit must be positive")
        if self.out_of_order not in ("process", "drop"):
            raise ConfigError(f"source {self.name!r}: out_of_order is 'process' or 'drop'")
        if self.out_of_order == "drop" and self.ordering is None:
            raise ConfigError(
                f"source {self.name!r}: out_of_order 'drop' needs an ordering extractor "
                "that returns a version"
            )
        if self.head_failure not in ("block", "park"):
            raise ConfigError(f"source {self.name!r}: head_failure is 'block' or 'park'")
        if self.handlers and self.event_type is None:
            raise ConfigError(f"source {self.name!r}: handlers by event type need event_type")
        if self.handler_timeout <= timedelta(0):
            raise ConfigError(f"source {self.name!r}: handler_timeout must be positive")

    @property
    def handles(self) -> bool:
        """Whether a worker has anything to run for this source's events."""
        return self.handler is not None or bool(self.handlers)

    def handler_for(self, payload: Any, headers: Headers) -> Handler | None:
        """The handler of one event: by its type when one is registered, else ``handler``."""
        if self.handlers and self.event_type is not None:
            chosen = self.handlers.get(self.event_type(payload, headers) or "")
            if chosen is not None:
                return chosen
        return self.handler


def by_name(sources: Iterable[Source]) -> Mapping[str, Source]:
    """``{name: source}``, refusing two sources with one name."""
    if isinstance(sources, Source) or not isinstance(sources, Iterable):
        hint = ": pass [source]" if isinstance(sources, Source) else ""
        raise ConfigError(
            f"the webhook sources must be a list of Source, not {describe(sources)}{hint}"
        )
    found: dict[str, Source] = {}
    for source in sources:
        if not isinstance(source, Source):
            raise ConfigError(f"not a webhook source: {source!r}")
        if source.name in found:
            raise ConfigError(f"two webhook sources are named {source.name!r}")
        found[source.name] = source
    return found
