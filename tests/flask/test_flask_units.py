"""The WSGI middleware in-process (Flask's test client, a bare WSGI app) on a real pool and a real
database: misuse refused with a clear error, and the WSGI details a server does not show."""

from __future__ import annotations

import io
import logging
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from flask import Flask, abort
from psycopg.errors import UniqueViolation
from psycopg_pool import ConnectionPool

from pgonce import AsyncKeyStore, KeyStore, UsageError
from pgonce.contrib.flask import Idempotency, connection, transaction
from pgonce.contrib.wsgi import (
    IdempotencyMiddleware,
    StartResponse,
    connection_of,
    header_scope,
)


@pytest.fixture
def pool(dsn: str) -> Iterator[ConnectionPool[Any]]:
    with ConnectionPool(dsn, min_size=1, max_size=2, open=True) as opened:
        yield opened


def keys(dsn: str) -> int:
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT count(*) FROM pgonce.keys").fetchone()
    assert row is not None
    return int(row[0])


def test_misuse_is_refused_when_the_app_is_built(pool: ConnectionPool[Any]) -> None:
    def app(environ: dict[str, Any], start_response: StartResponse) -> list[bytes]:
        return []

    with pytest.raises(UsageError, match="Flask app"):
        Idempotency(app, pool=pool, key_scope=lambda e: "s")  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="key_scope"):
        IdempotencyMiddleware(app, pool=pool, key_scope="tenant")  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="pool"):
        IdempotencyMiddleware(app, pool=object(), key_scope=lambda e: "s")  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="sync one"):
        IdempotencyMiddleware(
            app,
            pool=pool,
            key_scope=lambda e: "s",
            store=AsyncKeyStore(),  # type: ignore[arg-type]
        )


def test_the_accessors_outside_a_claimed_request_say_why(pool: ConnectionPool[Any]) -> None:
    with pytest.raises(UsageError, match="inside a Flask request"):
        transaction()
    app = Flask(__name__)
    Idempotency(app, pool=pool, key_scope=lambda e: "s")
    with (
        app.test_request_context("/things", method="GET"),
        pytest.raises(UsageError, match="no idempotent transaction"),
    ):
        connection()


def test_a_view_that_asks_for_the_claim_of_an_anonymous_request_is_401(
    pool: ConnectionPool[Any], dsn: str
) -> None:
    app = Flask(__name__)
    Idempotency(app, pool=pool, key_scope=header_scope("X-Api-Key"))

    @app.post("/things")
    def things() -> tuple[str, int]:
        connection().execute("SELECT 1")
        return "made", 201

    client = app.test_client()
    anonymous = client.post("/things", headers={"Idempotency-Key": "k"})
    assert anonymous.status_code == 401
    assert anonymous.headers["Content-Type"] == "application/problem+json"
    made = client.post("/things", headers={"Idempotency-Key": "k", "X-Api-Key": "secret"})
    assert made.status_code == 201
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT scope FROM pgonce.keys").fetchone()
    assert row is not None
    assert "secret" not in row[0]  # the credential is stored as its SHA-256 only


def test_a_bare_wsgi_app_with_write_and_close_is_captured_whole(
    pool: ConnectionPool[Any], dsn: str
) -> None:
    closed: list[bool] = []

    class Body:
        def __iter__(self) -> Iterator[bytes]:
            yield b"-tail"

        def close(self) -> None:
            closed.append(True)

    def app(environ: dict[str, Any], start_response: StartResponse) -> Body:
        connection_of(environ).execute("SELECT 1")
        write = start_response("202 Accepted", [("Content-Type", "text/plain")])
        write(b"head")  # PEP 3333's legacy write(): its bytes come first
        return Body()

    wrapped = IdempotencyMiddleware(app, pool=pool, key_scope=lambda e: "tenant")
    answers = []
    seen: dict[str, Any] = {}

    def start_response(status: str, headers: list[tuple[str, str]], exc: Any = None) -> Any:
        seen.update(status=status, headers=dict(headers))

    for _ in range(2):
        environ = {
            "REQUEST_METHOD": "POST",
            "PATH_INFO": "/jobs",
            "CONTENT_LENGTH": "2",
            "HTTP_IDEMPOTENCY_KEY": "job-1",
            "wsgi.input": io.BytesIO(b"{}"),
        }
        result = wrapped(environ, start_response)
        body = b"".join(result)
        getattr(result, "close", lambda: None)()  # as a PEP 3333 server does, after sending
        answers.append((seen["status"], body, seen["headers"]))
    (status, body, headers), (status2, body2, headers2) = answers
    assert (status, body) == (status2, body2) == ("202 Accepted", b"head-tail")
    assert "idempotency-key-expires" in headers
    assert headers2["idempotent-replayed"] == "true"
    assert closed == [True]  # the first run's iterable was closed; the replay ran nothing
    assert keys(dsn) == 1


def test_a_response_header_outside_latin_1_is_refused_and_nothing_is_kept(
    pool: ConnectionPool[Any], dsn: str
) -> None:
    # PEP 3333: header values are latin-1. One a server could not send is never stored (the
    # application fails, its transaction and the claim roll back); a retry could not replay it.
    def app(environ: dict[str, Any], start_response: StartResponse) -> list[bytes]:
        connection_of(environ).execute("SELECT 1")
        start_response("201 Created", [("Location", "/caf\u00e9/\u20ac")])
        return [b"{}"]

    wrapped = IdempotencyMiddleware(app, pool=pool, key_scope=lambda e: "tenant")
    environ = {
        "REQUEST_METHOD": "POST",
        "PATH_INFO": "/jobs",
        "CONTENT_LENGTH": "2",
        "HTTP_IDEMPOTENCY_KEY": "euro-1",
        "wsgi.input": io.BytesIO(b"{}"),
    }

    def start_response(status: str, headers: list[tuple[str, str]], exc: Any = None) -> Any:
        raise AssertionError("nothing is answered")

    with pytest.raises(UnicodeEncodeError):
        wrapped(environ, start_response)
    assert keys(dsn) == 0


def written(dsn: str) -> tuple[int, int]:
    """(the things written, the keys stored), as another connection sees them."""
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT (SELECT count(*) FROM things), (SELECT count(*) FROM pgonce.keys)"
        ).fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


@pytest.fixture
def things(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE things (name text PRIMARY KEY)")


@pytest.mark.usefixtures("things")
def test_a_view_that_raises_is_rolled_back_whatever_flask_answers_for_it(
    pool: ConnectionPool[Any], dsn: str
) -> None:
    app = Flask(__name__)
    # A store that keeps 5xx too: pgonce's own 503 must never be kept, whatever it keeps.
    Idempotency(app, pool=pool, key_scope=lambda e: "s", store=KeyStore(store_server_errors=True))
    other = ConnectionPool(dsn, min_size=0, max_size=1, timeout=0.1, open=True)

    @app.errorhandler(UniqueViolation)
    def taken(error: Exception) -> tuple[str, int]:
        return "taken", 409

    @app.post("/abort")
    def aborted() -> str:
        connection().execute("INSERT INTO things VALUES ('aborted')")
        abort(409)

    @app.post("/unique")
    def unique() -> str:
        connection().execute("INSERT INTO things VALUES ('first')")
        connection().execute("INSERT INTO things VALUES ('first')")  # the handler's 409
        return "never"

    @app.post("/elsewhere")
    def elsewhere() -> str:
        connection().execute("INSERT INTO things VALUES ('elsewhere')")
        with other.connection(), other.connection():  # another pool's timeout: pgonce's 503
            return "never"

    client = app.test_client()
    try:
        for path, status in (("/abort", 409), ("/unique", 409), ("/elsewhere", 503)):
            for attempt in range(2):  # the retry runs the view again: nothing was stored
                answer = client.post(path, headers={"Idempotency-Key": f"{path}-k"})
                assert answer.status_code == status, (path, attempt)
                assert "Idempotent-Replayed" not in answer.headers
                assert "Idempotency-Key-Expires" not in answer.headers
        assert written(dsn) == (0, 0)
    finally:
        other.close()


@pytest.mark.usefixtures("things")
def test_an_after_request_function_that_raises_is_rolled_back_and_not_stored(
    pool: ConnectionPool[Any], dsn: str
) -> None:
    # Flask answers it 500 through handle_exception, not handle_user_exception: the request
    # still raised after the view wrote, so nothing of it is kept, even by a store that keeps
    # server errors.
    app = Flask(__name__)
    Idempotency(app, pool=pool, key_scope=lambda e: "s", store=KeyStore(store_server_errors=True))

    @app.post("/after")
    def after() -> tuple[str, int]:
        connection().execute("INSERT INTO things VALUES ('after')")
        return "made", 201

    @app.after_request
    def audit(response: Any) -> Any:
        raise RuntimeError("the audit failed after the view wrote")

    client = app.test_client()
    for _ in range(2):  # the retry runs the view again: nothing was stored
        answer = client.post("/after", headers={"Idempotency-Key": "k-after"})
        assert answer.status_code == 500
        assert "Idempotent-Replayed" not in answer.headers
        assert "Idempotency-Key-Expires" not in answer.headers
    assert written(dsn) == (0, 0)


@pytest.mark.usefixtures("things")
def test_a_view_that_rolls_back_and_writes_anew_commits_nothing_and_is_500(
    pool: ConnectionPool[Any], dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    app = Flask(__name__)
    Idempotency(app, pool=pool, key_scope=lambda e: "s")

    @app.post("/again")
    def again() -> tuple[str, int]:
        connection().rollback()  # misuse: the claim goes with it
        connection().execute("INSERT INTO things VALUES ('again')")
        return "made", 201

    with caplog.at_level(logging.ERROR, logger="pgonce.http"):
        answer = app.test_client().post("/again", headers={"Idempotency-Key": "k"})
    # The write after the rollback went into a transaction psycopg opened anew: the commit
    # found the claim's transaction ended and rolled it back; the key stays free.
    assert answer.status_code == 500
    assert answer.headers["Content-Type"] == "application/problem+json"
    assert "Idempotency-Key-Expires" not in answer.headers
    assert written(dsn) == (0, 0)
    assert any("ended by its endpoint" in r.getMessage() for r in caplog.records)
