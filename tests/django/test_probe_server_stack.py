"""Django's own middleware around and inside pgonce's, and DRF's throttling, under gunicorn and
uvicorn.

Real projects list SessionMiddleware, CsrfViewMiddleware, MessageMiddleware and GZipMiddleware
next to pgonce's. Each server here runs this module's own views and ``MIDDLEWARE`` (the
``PROBE_MIDDLEWARE`` environment variable, comma-separated), on the Django test project's
database: a refusal such a middleware (or DRF's throttle) gives before the view's first query is
not stored, cookies are never replayed, and a replay is the answer the first client got (many
headers, text outside ASCII), compressed for each client when GZipMiddleware runs outside
pgonce's.
"""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
from django.db import connection
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.urls import path
from psycopg.conninfo import make_conninfo

from tests.adapters.conftest import GUNICORN, Adapter, django_template
from tests.conftest import drop_database, new_database
from tests.http.conftest import Server, start_server

PGONCE = "pgonce.contrib.django.middleware.IdempotencyMiddleware"
SESSION = "django.contrib.sessions.middleware.SessionMiddleware"
CSRF = "django.middleware.csrf.CsrfViewMiddleware"
MESSAGES = "django.contrib.messages.middleware.MessageMiddleware"
GZIP = "django.middleware.gzip.GZipMiddleware"
COMMON = "django.middleware.common.CommonMiddleware"

ALICE = {"Authorization": "Bearer alice-token"}
#: The DatabaseCache's table, for the views whose cache is in the database.
CACHE_TABLE = "probe_cache"
#: A CSRF secret as Django's cookie holds it (32 characters of its alphabet).
CSRF_TOKEN = "a" * 32


def _settings() -> dict[str, Any]:
    """The test project's settings, with this module's routes and the probe's middleware."""
    import tests.django.settings as base

    names = {name: getattr(base, name) for name in dir(base) if name.isupper()}
    names["ROOT_URLCONF"] = os.environ.get("PROBE_URLCONF", __name__)
    names["MIDDLEWARE"] = os.environ["PROBE_MIDDLEWARE"].split(",")
    names["INSTALLED_APPS"] = [
        *base.INSTALLED_APPS,
        "django.contrib.sessions",
        "django.contrib.messages",
    ]
    # Sessions in a signed cookie: no table; the cookie is what a replay must never hand out.
    names["SESSION_ENGINE"] = "django.contrib.sessions.backends.signed_cookies"
    names["MESSAGE_STORAGE"] = "django.contrib.messages.storage.session.SessionStorage"
    names["CACHES"] = {
        "default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"},
        # A table the test makes (what manage.py createcachetable makes).
        "db": {"BACKEND": "django.core.cache.backends.db.DatabaseCache", "LOCATION": CACHE_TABLE},
    }
    return names


def _configure() -> None:
    from django.conf import settings

    settings.configure(**_settings())


def wsgi() -> Any:
    """gunicorn's ``module:wsgi()``: the WSGI application on this module's settings."""
    _configure()
    from django.core.wsgi import get_wsgi_application

    return get_wsgi_application()


def asgi() -> Any:
    """bench.servers' factory: the ASGI application on this module's settings."""
    _configure()
    from django.core.asgi import get_asgi_application

    return get_asgi_application()


def _pay(principal: str) -> int:
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO payments (principal, amount, currency, created_at) "
            "VALUES (%s, 1, 'EUR', now()) RETURNING id",
            [principal],
        )
        row = cursor.fetchone()
    return int(row[0])


def remember(request: HttpRequest) -> HttpResponse:
    """Pays, keeps the payment in the caller's session and leaves a message for the next page."""
    from django.contrib import messages

    payment = _pay("session")
    request.session["last_payment"] = payment
    messages.success(request, f"payment {payment} made")
    return JsonResponse({"id": payment}, status=201)


def big(request: HttpRequest) -> HttpResponse:
    """A compressible answer (GZipMiddleware leaves out bodies under 200 bytes)."""
    payment = _pay("gzip")
    return JsonResponse({"id": payment, "items": ["line"] * 200}, status=201)


#: Header values as a view sets them: one Latin-1 (sent as its byte), one outside it (Django
#: MIME-encodes it), and many more.
LATIN_1 = "café"
OUTSIDE_LATIN_1 = "paid ✓"
MANY = 300


def headers(request: HttpRequest) -> HttpResponse:
    payment = _pay("headers")
    response = JsonResponse({"id": payment}, status=201)
    response["X-Latin-1"] = LATIN_1
    response["X-Outside-Latin-1"] = OUTSIDE_LATIN_1
    for number in range(MANY):
        response[f"X-Header-{number}"] = f"value {number}"
    return response


def health(request: HttpRequest) -> HttpResponse:
    return HttpResponse("ok")


def _routes() -> list[Any]:
    """The routes, built when Django asks for them: DRF's classes need Django's settings, which
    a server process configures only after it imported this module."""
    from django.core.cache import caches
    from rest_framework.request import Request
    from rest_framework.response import Response
    from rest_framework.throttling import SimpleRateThrottle
    from rest_framework.views import APIView

    class OnePerCaller(SimpleRateThrottle):
        rate = "1/hour"

        def get_cache_key(self, request: Request, view: APIView) -> str:
            return f"throttle:{request.META.get('HTTP_AUTHORIZATION')}"

    class Throttled(APIView):
        throttle_classes = (OnePerCaller,)

        def post(self, request: Request) -> Response:
            return Response({"id": _pay("throttled")}, status=201)

    def forget(request: HttpRequest) -> HttpResponse:
        caches["default"].clear()
        return HttpResponse("forgotten")

    return [
        path("remember", remember),
        path("big", big),
        path("headers", headers),
        path("throttled", Throttled.as_view()),
        path("forget", forget),
        path("health", health),
    ]


def __getattr__(name: str) -> Any:
    if name == "urlpatterns":  # what Django reads of ROOT_URLCONF
        return _routes()
    raise AttributeError(name)


ADAPTERS = {
    "django-wsgi": Adapter("django-wsgi", (*GUNICORN[:-1], f"{__name__}:wsgi()"), django_template),
    "django-asgi": Adapter(
        "django-asgi",
        (sys.executable, "-m", "bench.servers", "{fd}", f"{__name__}:asgi"),
        django_template,
    ),
}


@pytest.fixture(params=sorted(ADAPTERS))
def adapter(request: pytest.FixtureRequest) -> Adapter:
    return ADAPTERS[request.param]


@pytest.fixture
def app_dsn(adapter: Adapter, server_dsn: str, template_db: str) -> Iterator[str]:
    """A database of this test's own, cloned from the Django test project's migrated one."""
    name = new_database(server_dsn, django_template(server_dsn, template_db))
    try:
        yield make_conninfo(server_dsn, dbname=name)
    finally:
        drop_database(server_dsn, name)


@pytest.fixture
def db(app_dsn: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(app_dsn, autocommit=True) as conn:
        yield conn


@pytest.fixture
def serve(adapter: Adapter, app_dsn: str, tmp_path: Path) -> Iterator[Any]:
    """Start this module's project with a ``MIDDLEWARE`` list; every server stops at teardown."""
    servers: list[Server] = []

    def start(*middleware: str, urlconf: str = __name__, **pgonce: Any) -> Server:
        """``urlconf``: another module's routes; ``pgonce``: PGONCE settings, in lower case."""
        log = tmp_path / f"server-{len(servers)}.log"
        env = {"PROBE_MIDDLEWARE": ",".join(middleware), "PROBE_URLCONF": urlconf}
        server = start_server(app_dsn, log, pgonce, adapter.argv, env)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


def post(server: Server, route: str, key: str, **kwargs: Any) -> httpx.Response:
    headers = {**ALICE, "Idempotency-Key": key, **kwargs.pop("headers", {})}
    return httpx.post(f"{server.url}/{route}", json={}, headers=headers, timeout=30, **kwargs)


def count(db: psycopg.Connection[Any], principal: str) -> int:
    row = db.execute("SELECT count(*) FROM payments WHERE principal = %s", (principal,)).fetchone()
    assert row is not None
    return int(row[0])


def stored(db: psycopg.Connection[Any]) -> int:
    row = db.execute("SELECT count(*) FROM pgonce.keys").fetchone()
    assert row is not None
    return int(row[0])


def test_a_csrf_refusal_inside_pgonce_is_not_stored_and_cookies_are_never_replayed(
    serve: Any, db: psycopg.Connection[Any]
) -> None:
    server = serve(COMMON, PGONCE, SESSION, CSRF, MESSAGES)
    key = uuid.uuid4().hex
    # Without the CSRF token: refused by CsrfViewMiddleware before the view, so not stored.
    refused = post(server, "remember", key)
    assert refused.status_code == 403, refused.text
    assert "idempotency-key-expires" not in refused.headers
    assert (count(db, "session"), stored(db)) == (0, 0)
    # The corrected request with the same key runs, and sets the session's cookie.
    csrf = {"X-CSRFToken": CSRF_TOKEN}
    cookies = {"csrftoken": CSRF_TOKEN}
    first = post(server, "remember", key, headers=csrf, cookies=cookies)
    assert first.status_code == 201, first.text
    assert "sessionid" in first.cookies
    assert "idempotency-key-expires" in first.headers
    again = post(server, "remember", key, headers=csrf, cookies=cookies)
    assert again.status_code == 201
    assert again.headers["idempotent-replayed"] == "true"
    assert again.content == first.content
    assert "set-cookie" not in again.headers
    assert (count(db, "session"), stored(db)) == (1, 1)


def test_gzip_outside_pgonce_compresses_each_answer_for_its_own_client(
    serve: Any, db: psycopg.Connection[Any]
) -> None:
    server = serve(GZIP, COMMON, PGONCE)
    key = uuid.uuid4().hex
    first = post(server, "big", key, headers={"Accept-Encoding": "gzip"})
    assert first.status_code == 201, first.text
    assert first.headers["content-encoding"] == "gzip"
    plain = post(server, "big", key, headers={"Accept-Encoding": "identity"})
    assert plain.headers["idempotent-replayed"] == "true"
    assert "content-encoding" not in plain.headers
    assert plain.content == first.content  # httpx decompressed the first
    zipped = post(server, "big", key, headers={"Accept-Encoding": "gzip"})
    assert zipped.headers["content-encoding"] == "gzip"
    assert zipped.content == first.content
    assert count(db, "gzip") == 1


def test_gzip_inside_pgonce_replays_the_first_clients_encoding(
    serve: Any, db: psycopg.Connection[Any]
) -> None:
    # As with the ASGI middleware: what a middleware inside pgonce's makes is the stored
    # response, Content-Encoding included, whatever the retry's own Accept-Encoding says.
    server = serve(COMMON, PGONCE, GZIP)
    key = uuid.uuid4().hex
    first = post(server, "big", key, headers={"Accept-Encoding": "gzip"})
    assert first.status_code == 201, first.text
    assert first.headers["content-encoding"] == "gzip"
    again = httpx.post(
        f"{server.url}/big",
        json={},
        headers={**ALICE, "Idempotency-Key": key, "Accept-Encoding": "identity"},
        timeout=30,
    )
    assert again.headers["idempotent-replayed"] == "true"
    assert again.headers["content-encoding"] == "gzip"
    assert "Accept-Encoding" in again.headers["vary"]
    assert again.content == first.content  # httpx decompressed both
    assert count(db, "gzip") == 1


#: What differs between two answers by design: the server's and the replay's own headers.
_PER_ANSWER = {"date", "server", "content-length", "idempotent-replayed", "connection"}


def _headers(response: httpx.Response) -> list[tuple[bytes, bytes]]:
    return [
        (name.lower(), value)
        for name, value in response.headers.raw
        if name.lower().decode() not in _PER_ANSWER
    ]


def test_many_headers_and_text_outside_ascii_are_replayed_as_first_sent(
    serve: Any, db: psycopg.Connection[Any]
) -> None:
    server = serve(COMMON, PGONCE)
    key = uuid.uuid4().hex
    first = post(server, "headers", key)
    assert first.status_code == 201, first.text
    sent = dict(_headers(first))
    assert sent[b"x-latin-1"] == LATIN_1.encode("latin-1")
    assert sent[b"x-outside-latin-1"].startswith(b"=?utf-8?")  # Django MIME-encodes it
    again = post(server, "headers", key)
    assert again.headers["idempotent-replayed"] == "true"
    assert again.content == first.content
    assert _headers(again) == _headers(first)
    assert len([n for n, _ in _headers(again) if n.startswith(b"x-header-")]) == MANY
    assert count(db, "headers") == 1


def test_a_throttled_request_is_not_stored_and_its_retry_after_the_wait_runs(
    serve: Any, db: psycopg.Connection[Any]
) -> None:
    server = serve(
        COMMON,
        PGONCE,
    )
    assert post(server, "throttled", uuid.uuid4().hex).status_code == 201
    key = uuid.uuid4().hex
    throttled = post(server, "throttled", key)
    assert throttled.status_code == 429, throttled.text
    assert "retry-after" in throttled.headers
    assert "idempotency-key-expires" not in throttled.headers
    # The window is over (the throttle's history forgotten): the retry with the same key runs.
    assert httpx.get(f"{server.url}/forget", timeout=30).status_code == 200
    retried = post(server, "throttled", key)
    assert retried.status_code == 201, retried.text
    assert "idempotent-replayed" not in retried.headers
    assert count(db, "throttled") == 2
