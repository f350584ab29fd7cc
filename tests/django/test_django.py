"""pgonce.contrib.django in Django's own test client, on pytest-django's PostgreSQL test database.

The database was made by ``migrate``: pgonce's tables come from the app's migration. Tests are
``transaction=True``: each commits for real (what is under test), and payments are counted in the
database, never trusted from a response.
"""

from __future__ import annotations

import io
import json
import logging
import math
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from asgiref.sync import async_to_sync
from django.core.management import call_command
from django.db import connection, transaction
from django.http import HttpResponse
from django.test import AsyncClient, Client

from examples.django_payments.payments.models import Payment, Refund
from examples.django_payments.payments.services import record_payment
from pgonce.contrib.django import conf
from pgonce.contrib.django.connection import check_backend, psycopg_connection
from pgonce.contrib.django.inbox import process_batch
from pgonce.contrib.django.middleware import IdempotencyMiddleware
from pgonce.contrib.django.outbox import enqueue
from pgonce.core.inbox import Delivery, Ordering, RetryPolicy
from pgonce.decorator import idempotent
from pgonce.errors import ConfigError, NotInTransaction, UsageError
from pgonce.store._sync.inbox import InboxStore

pytestmark = pytest.mark.django_db(transaction=True)

ALICE = {"HTTP_AUTHORIZATION": "Bearer alice-token"}
PAYMENT = {"amount": 1000, "currency": "EUR"}


def new_key() -> str:
    return str(uuid.uuid4())


def post(client: Client, path: str, key: str | None, body: Any = PAYMENT, **headers: Any) -> Any:
    extra = {**ALICE, **headers}
    if key is not None:
        extra["HTTP_IDEMPOTENCY_KEY"] = key
    return client.post(path, json.dumps(body), content_type="application/json", **extra)


def scalar(query: str, *params: Any) -> Any:
    with connection.cursor() as cur:
        cur.execute(query, params)
        row = cur.fetchone()
    assert row is not None
    return row[0]


def stored_keys(key: str) -> int:
    return int(scalar("SELECT count(*) FROM pgonce.keys WHERE key = %s", key))


@pytest.mark.parametrize("path", ["/payments", "/drf/payments", "/async/payments"])
def test_a_retry_replays_the_stored_answer_and_pays_once(
    client: Client, atomic_requests: bool, path: str
) -> None:
    if atomic_requests and path.startswith("/async"):
        pytest.skip("Django refuses ATOMIC_REQUESTS with async views")
    key = new_key()
    first = post(client, path, key)
    second = post(client, path, key)
    assert first.status_code == second.status_code == 201, first.content
    assert "Idempotent-Replayed" not in first.headers
    assert second.headers["Idempotent-Replayed"] == "true"
    assert second.content == first.content
    assert second.headers["Location"] == first.headers["Location"]
    assert second.headers["Idempotency-Key-Expires"] == first.headers["Idempotency-Key-Expires"]
    assert Payment.objects.count() == 1
    assert stored_keys(key) == 1


def test_inside_an_outer_atomic_block_the_claim_joins_it_and_never_commits(
    client: Client,
) -> None:
    # Whoever opened the transaction ends it: the middleware neither commits nor rolls it back.
    key = new_key()
    with pytest.raises(RuntimeError), transaction.atomic():
        assert post(client, "/payments", key).status_code == 201
        assert post(client, "/payments", key).headers["Idempotent-Replayed"] == "true"
        raise RuntimeError("the outer block fails after the request")
    assert Payment.objects.count() == 0
    assert stored_keys(key) == 0
    with transaction.atomic():
        assert post(client, "/payments", key).status_code == 201
    assert Payment.objects.count() == 1
    assert stored_keys(key) == 1


def test_on_a_direct_connection_pgonce_prepares_its_statements_though_django_does_not() -> None:
    # Django connects with prepare_threshold=None; the server would otherwise parse and plan
    # BEGIN with the claim and the completion with COMMIT again on every request.
    kept = connection.settings_dict["CONN_MAX_AGE"]
    connection.settings_dict["CONN_MAX_AGE"] = None  # keep the connection across requests
    try:
        for _ in range(2):
            assert post(Client(), "/payments", new_key()).status_code == 201
        assert connection.connection.prepare_threshold is None
        names = scalar("SELECT count(*) FROM pg_prepared_statements WHERE name LIKE '_pgonce_%%'")
    finally:
        connection.settings_dict["CONN_MAX_AGE"] = kept
        connection.close()
    assert names == 4  # BEGIN, the claim, the completion, COMMIT: once each


def test_a_view_that_raises_rolls_back_its_writes_and_the_claim(
    atomic_requests: bool,
) -> None:
    client = Client(raise_request_exception=False)
    key = new_key()
    assert post(client, "/boom", key).status_code == 500
    assert post(client, "/boom", key).status_code == 500  # ran again: the key was free
    assert Payment.objects.count() == 0
    assert stored_keys(key) == 0


def test_a_5xx_answer_is_rolled_back_and_not_stored(client: Client, atomic_requests: bool) -> None:
    key = new_key()
    assert post(client, "/fail", key).status_code == 503
    second = post(client, "/fail", key)
    assert second.status_code == 503
    assert "Idempotent-Replayed" not in second.headers
    assert Payment.objects.count() == 0
    assert stored_keys(key) == 0


@pytest.mark.parametrize(("path", "refused"), [("/payments", 422), ("/drf/payments", 400)])
def test_a_refusal_before_any_query_is_not_stored(
    client: Client, atomic_requests: bool, path: str, refused: int
) -> None:
    # The view (DRF's serializer here) refuses before it writes: no query ran, so the refusal
    # is not kept and the corrected retry with the same key runs. The savepoint ATOMIC_REQUESTS
    # opens around the view is Django's, not a query of the view.
    key = new_key()
    invalid = post(client, path, key, {"amount": 0, "currency": "EUR"})
    assert invalid.status_code == refused
    assert stored_keys(key) == 0
    fixed = post(client, path, key)
    again = post(client, path, key)
    assert fixed.status_code == again.status_code == 201
    assert again.headers["Idempotent-Replayed"] == "true"
    assert Payment.objects.count() == 1


def test_a_view_that_begins_without_a_query_is_stored(client: Client) -> None:
    key = new_key()
    first = post(client, "/no-db", key)
    second = post(client, "/no-db", key)
    assert first.status_code == 201
    assert second.content == first.content
    assert second.headers["Idempotent-Replayed"] == "true"


def test_a_cookie_is_set_on_the_first_answer_and_never_replayed(client: Client) -> None:
    key = new_key()
    first = post(client, "/cookie", key)
    assert first.cookies["session"].value == "secret-session-id"
    replay = Client().post(
        "/cookie",
        json.dumps(PAYMENT),
        content_type="application/json",
        **ALICE,
        HTTP_IDEMPOTENCY_KEY=key,
    )
    assert replay.headers["Idempotent-Replayed"] == "true"
    assert "session" not in replay.cookies
    assert "Set-Cookie" not in replay.headers
    assert replay.headers["X-Custom"] == "kept"


def test_a_streamed_response_is_buffered_stored_and_replayed(client: Client) -> None:
    key = new_key()
    first = post(client, "/stream?chunks=3&size=10", key)
    second = post(client, "/stream?chunks=3&size=10", key)
    body = b"".join(first.streaming_content)
    assert len(body) == 30
    assert second.content == body
    assert Payment.objects.count() == 1


def test_a_write_made_while_the_body_streams_commits_with_the_stored_answer(
    client: Client, atomic_requests: bool
) -> None:
    # The generator runs inside the transaction: its write is the view's first query.
    key = new_key()
    first = post(client, "/stream-write", key)
    assert first.status_code == 201
    body = b"".join(first.streaming_content)
    assert "Idempotency-Key-Expires" in first.headers
    assert list(Payment.objects.values_list("pk", flat=True)) == [int(body)]
    again = post(client, "/stream-write", key)
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.content == body
    assert Payment.objects.count() == 1
    assert stored_keys(key) == 1


@pytest.mark.parametrize("kind", ["404", "403", "400"])
def test_a_view_that_raises_a_client_error_is_rolled_back_and_not_stored(
    atomic_requests: bool, kind: str
) -> None:
    # Django answers Http404, PermissionDenied and SuspiciousOperation itself, before the
    # middleware sees a response; they are still a view that raised after its write.
    client = Client(raise_request_exception=False)
    key = new_key()
    first = post(client, f"/raise-after-write?kind={kind}", key)
    second = post(client, f"/raise-after-write?kind={kind}", key)
    assert first.status_code == second.status_code == int(kind)
    assert "Idempotency-Key-Expires" not in first.headers
    assert "Idempotent-Replayed" not in second.headers  # ran again: the key was free
    assert Payment.objects.count() == 0
    assert stored_keys(key) == 0


def test_a_drf_exception_is_the_answer_the_view_returned(
    client: Client, atomic_requests: bool
) -> None:
    # DRF turns it into a Response inside the view, so it is stored once the view began, with
    # the view's write. Under ATOMIC_REQUESTS DRF marks the view's transaction for rollback
    # instead: nothing of it commits, the answer neither, and the retry runs again.
    key = new_key()
    first = post(client, "/drf/raise-after-write", key)
    second = post(client, "/drf/raise-after-write", key)
    assert first.status_code == second.status_code == 400
    assert second.content == first.content
    if atomic_requests:
        assert "Idempotent-Replayed" not in second.headers
        assert Payment.objects.count() == 0
        assert stored_keys(key) == 0
    else:
        assert second.headers["Idempotent-Replayed"] == "true"
        assert Payment.objects.count() == 1
        assert stored_keys(key) == 1


def test_a_view_that_swallows_its_failed_statement_is_answered_rolled_back_and_not_stored(
    atomic_requests: bool,
) -> None:
    # The view catches the error of its own statement and answers 409: the transaction is
    # aborted, so nothing of it can commit; its answer goes out and the key stays free. Under
    # ATOMIC_REQUESTS Django's own block refuses to end the aborted savepoint (500).
    client = Client(raise_request_exception=False)
    key = new_key()
    first = post(client, "/swallow-db-error", key)
    second = post(client, "/swallow-db-error", key)
    assert first.status_code == second.status_code == (500 if atomic_requests else 409)
    assert "Idempotency-Key-Expires" not in first.headers
    assert "Idempotent-Replayed" not in second.headers  # ran again: the key was free
    assert Payment.objects.count() == 0
    assert stored_keys(key) == 0


def test_a_view_that_ends_the_transaction_and_writes_anew_commits_nothing_and_is_500(
    client: Client, caplog: pytest.LogCaptureFixture
) -> None:
    # The write after the end went into a transaction psycopg opened anew: the commit found the
    # claim's transaction ended and rolled it back, and the log says what the view did.
    key = new_key()
    with caplog.at_level(logging.ERROR, logger="pgonce.http"):
        first = post(client, "/rollback-and-write-anew", key)
    assert first.status_code == 500
    assert first.headers["Content-Type"] == "application/problem+json"
    assert "Idempotency-Key-Expires" not in first.headers
    assert any("ended by its endpoint" in record.getMessage() for record in caplog.records)
    assert stored_keys(key) == 0
    assert Payment.objects.count() == 0


@pytest.mark.parametrize("path", ["/stream?chunks=5&size=1000", "/payments"])
def test_an_answer_over_max_response_bytes_is_500_and_rolled_back(
    settings: Any, atomic_requests: bool, path: str
) -> None:
    settings.PGONCE = {**settings.PGONCE, "MAX_RESPONSE_BYTES": 40}
    client = Client()  # its handler builds the middleware with the limit above
    key = new_key()
    for _ in range(2):  # the key stays free: the view runs again, and is refused again
        refused = post(client, path, key)
        assert refused.status_code == 500
        assert refused.headers["Content-Type"] == "application/problem+json"
        assert json.loads(refused.content)["status"] == 500
        assert "Idempotency-Key-Expires" not in refused.headers
    assert Payment.objects.count() == 0
    assert stored_keys(key) == 0


def test_on_commit_hooks_run_once_after_the_commit_and_never_for_a_rollback(
    client: Client, atomic_requests: bool
) -> None:
    from tests.django.views import COMMITTED as committed

    committed.clear()
    key = new_key()
    first = post(client, "/committed-hook", key)
    again = post(client, "/committed-hook", key)
    assert again.headers["Idempotent-Replayed"] == "true"
    assert committed == [first.json()["id"]]  # once, after the commit; the replay runs no view
    failed = new_key()
    assert post(client, "/committed-hook?status=503", failed).status_code == 503
    assert committed == [first.json()["id"]]  # rolled back: its hook never ran
    assert stored_keys(failed) == 0


def test_a_key_scope_that_loses_the_database_is_answered_503(settings: Any) -> None:
    # The server ended the thread's persistent connection between two requests (a restart, a
    # failover): the next request's key scope reads the database first (as user_scope loads the
    # session's user) and meets the loss there, before the claim. 503 and Retry-After, as when
    # the claim meets it, never a 500; the retry reconnects and runs.
    settings.PGONCE = {**settings.PGONCE, "SCOPE": "tests.django.views.database_scope"}
    kept = connection.settings_dict["CONN_MAX_AGE"]
    connection.settings_dict["CONN_MAX_AGE"] = None  # keep the connection across requests
    try:
        client = Client(raise_request_exception=False)
        assert post(client, "/payments", new_key()).status_code == 201
        with psycopg.connect(connection.connection.info.dsn, autocommit=True) as other:
            pid = connection.connection.info.backend_pid
            other.execute("SELECT pg_terminate_backend(%s)", (pid,))
        key = new_key()
        lost = post(client, "/payments", key)
        assert lost.status_code == 503
        assert lost.headers["Content-Type"] == "application/problem+json"
        assert int(lost.headers["Retry-After"]) >= 0
        # What a server's request_finished does (Django's test client leaves it out).
        connection.close_if_unusable_or_obsolete()
        retried = post(client, "/payments", key)
        assert retried.status_code == 201
    finally:
        connection.settings_dict["CONN_MAX_AGE"] = kept
        connection.close()
    assert Payment.objects.count() == 2


def test_a_view_that_loses_the_database_is_answered_503_and_rolled_back(
    client: Client, atomic_requests: bool
) -> None:
    key = new_key()
    lost = post(client, "/lose-connection?lose=1", key)
    assert lost.status_code == 503
    assert lost.headers["Content-Type"] == "application/problem+json"
    assert int(lost.headers["Retry-After"]) >= 0
    assert json.loads(lost.content)["status"] == 503
    assert Payment.objects.count() == 0
    assert stored_keys(key) == 0
    retried = post(client, "/lose-connection", key)  # the key is free: the view runs
    assert retried.status_code == 201
    assert "Idempotent-Replayed" not in retried.headers
    assert Payment.objects.count() == 1
    assert stored_keys(key) == 1


def test_under_asgi_a_utf8_query_string_is_fingerprinted_from_its_bytes() -> None:
    # Django's ASGI handler decodes the query string as UTF-8; its bytes are what pgonce's
    # ASGI middleware fingerprints for the same request.
    key = new_key()
    query = "note=\u2713".encode()
    body = json.dumps(PAYMENT).encode()

    async def send() -> Any:
        return await AsyncClient().post(
            "/async/payments",
            body,
            content_type="application/json",
            QUERY_STRING=query,
            headers={"Authorization": ALICE["HTTP_AUTHORIZATION"], "Idempotency-Key": key},
        )

    assert async_to_sync(send)().status_code == 201
    rules = IdempotencyMiddleware(lambda request: HttpResponse()).rules
    expected = rules.fingerprint("POST", "/async/payments", query, body, "application/json")
    assert bytes(scalar("SELECT fingerprint FROM pgonce.keys WHERE key = %s", key)) == expected


# --- the outbox and the inbox on the ORM's transaction ------------------------------------------


def test_an_outbox_event_commits_and_rolls_back_with_the_orm_write() -> None:
    # pytest-django empties Django's tables between tests, not pgonce's: count from here.
    before = scalar("SELECT count(*) FROM pgonce.outbox")
    with transaction.atomic():
        payment = Payment.objects.create(principal="a", amount=5, currency="EUR")
        enqueue("payment", str(payment.pk), "payment.created", {"amount": 5})
    with pytest.raises(RuntimeError), transaction.atomic():
        other = Payment.objects.create(principal="a", amount=6, currency="EUR")
        enqueue("payment", str(other.pk), "payment.created", {"amount": 6})
        raise RuntimeError("the business transaction failed")
    assert Payment.objects.count() == 1
    assert scalar("SELECT count(*) FROM pgonce.outbox") == before + 1
    last = scalar("SELECT aggregateid FROM pgonce.outbox ORDER BY id DESC LIMIT 1")
    assert last == str(payment.pk)


def test_enqueue_outside_atomic_is_refused() -> None:
    before = scalar("SELECT count(*) FROM pgonce.outbox")
    with pytest.raises(NotInTransaction):
        enqueue("payment", "1", "payment.created", {})
    assert scalar("SELECT count(*) FROM pgonce.outbox") == before


def test_the_connection_handed_out_at_the_start_of_an_atomic_block_is_never_committed() -> None:
    # Before its first statement the block's transaction is not open on the server: a pgonce
    # call that owns a transaction on an idle connection must not take the block's for one.
    @idempotent(key="order", commit=True)
    def pay(conn: psycopg.Connection[Any], order: str) -> int:
        return int(Payment.objects.create(principal="a", amount=7, currency="EUR").pk)

    with pytest.raises(UsageError), transaction.atomic():
        pay(psycopg_connection("default"), new_key())
    assert Payment.objects.count() == 0


def _deliver(
    *bodies: dict[str, Any], source: str = "shop", ordering: list[Ordering] | None = None
) -> None:
    store = InboxStore()
    for n, body in enumerate(bodies):  # one by one: arrival order is delivery order
        with transaction.atomic():
            store.store(
                psycopg_connection("default"),
                [
                    Delivery(
                        source,
                        f"evt-{n}",
                        json.dumps(body).encode(),
                        {},
                        b"\0" * 32,
                        ordering[n] if ordering else None,
                    )
                ],
            )


def test_inbox_handlers_write_with_the_orm_in_the_events_transaction() -> None:
    _deliver({"amount": 1}, {"amount": -1}, {"amount": 3})

    def handler(event: Any) -> None:
        Payment.objects.create(principal="shop", amount=event.payload["amount"], currency="EUR")
        if event.payload["amount"] < 0:
            raise ValueError("a refund is not a payment")

    now = datetime.now(UTC)
    assert process_batch("shop", handler, retry=RetryPolicy(attempts=3), now=now) == 3
    # The failed handler's payment was rolled back with its savepoint; the others committed.
    assert sorted(Payment.objects.values_list("amount", flat=True)) == [1, 3]
    rows = {event_id: (status, attempts) for event_id, status, attempts in _inbox_rows()}
    assert rows == {"evt-0": ("done", 0), "evt-1": ("pending", 1), "evt-2": ("done", 0)}
    assert process_batch("shop", handler, now=now) == 0  # the failed one waits for its backoff


def test_a_handler_that_marks_its_transaction_for_rollback_is_retried_with_that_reason() -> None:
    _deliver({"amount": 1}, source="set-rollback")

    def handler(event: Any) -> None:
        Payment.objects.create(principal="shop", amount=event.payload["amount"], currency="EUR")
        transaction.set_rollback(True)

    assert process_batch("set-rollback", handler, now=datetime.now(UTC)) == 1
    assert not Payment.objects.exists()
    assert [row[1:] for row in _inbox_rows("set-rollback")] == [("pending", 1)]
    with connection.cursor() as cur:
        cur.execute("SELECT last_error FROM pgonce.inbox WHERE source = 'set-rollback'")
        (error,) = cur.fetchone()
    assert error.startswith("InboxHandlerError: the handler marked its transaction for rollback")


def test_an_async_handler_never_has_its_events_marked_done() -> None:
    # Called and never awaited, it would do nothing while every claimed event was marked done.
    _deliver({"amount": 1}, source="async-handler")

    async def handler(event: Any) -> None:
        Payment.objects.create(principal="shop", amount=1, currency="EUR")

    with pytest.raises(UsageError, match="plain def"):
        process_batch("async-handler", handler, now=datetime.now(UTC))

    class Handler:  # a plain callable whose call returns a coroutine: found when it runs
        def __call__(self, event: Any) -> Any:
            return handler(event)

    assert process_batch("async-handler", Handler(), now=datetime.now(UTC)) == 1
    assert not Payment.objects.exists()
    assert [row[1:] for row in _inbox_rows("async-handler")] == [("pending", 1)]


def _inbox_rows(source: str = "shop") -> list[tuple[str, str, int]]:
    with connection.cursor() as cur:
        cur.execute(
            "SELECT event_id, status, attempts FROM pgonce.inbox WHERE source = %s "
            "ORDER BY event_id",
            [source],
        )
        return [(str(a), str(b), int(c)) for a, b, c in cur.fetchall()]


# --- configuration, backend and schema ----------------------------------------------------------


def test_settings_are_checked_with_every_problem_listed() -> None:
    with pytest.raises(ConfigError) as caught:
        conf.load({"SCOPE": "no.such.function", "WAIT": -1, "METHODS": "POST", "COLOUR": 1})
    message = str(caught.value)
    for fragment in ("SCOPE", "WAIT", "METHODS", "COLOUR"):
        assert fragment in message
    with pytest.raises(ConfigError, match="SCOPE"):
        conf.load({})
    loaded = conf.load({"SCOPE": "pgonce.contrib.django.scopes.user_scope", "WAIT": 0.5})
    assert loaded.wait is not None
    assert loaded.wait.total_seconds() == 0.5


@pytest.mark.parametrize(
    "setting",
    [
        {"WAIT": math.inf},
        {"WAIT": 1e20},
        {"WAIT": timedelta(seconds=-1)},
        {"RETENTION": math.inf},
        {"RETENTION": timedelta(seconds=-1)},
        {"METHODS": None},
        {"METHODS": 5},
        {"METHODS": {"POST": True}},
        {"METHODS": ["PO ST"]},
        {"ROUTES": {"/webhooks": None}},
        {"ROUTES": {"webhooks": []}},
        {"DATABASE": "replica"},
    ],
    ids=repr,
)
def test_a_setting_of_the_wrong_shape_is_a_config_error_at_start(setting: dict[str, Any]) -> None:
    name = next(iter(setting))
    with pytest.raises(ConfigError, match=name):
        conf.load({"SCOPE": "pgonce.contrib.django.scopes.user_scope", **setting})


def test_a_schema_name_the_core_settings_refuse_is_refused_at_start() -> None:
    scope = "pgonce.contrib.django.scopes.user_scope"
    for schema in ("Pgonce", "pgonce; drop", "", "x" * 64, 5):
        with pytest.raises(ConfigError, match="SCHEMA"):
            conf.load({"SCOPE": scope, "SCHEMA": schema})
    assert conf.load({"SCOPE": scope, "SCHEMA": "once_2"}).schema == "once_2"


def test_a_database_that_is_not_postgresql_is_refused_clearly() -> None:
    with pytest.raises(ConfigError, match=r"needs PostgreSQL.*sqlite"):
        check_backend("sqlite")
    check_backend("default")


def test_a_database_without_autocommit_is_refused_at_start() -> None:
    # Django's outermost atomic() would then never commit: every answer would be a lie.
    connection.settings_dict["AUTOCOMMIT"] = False
    try:
        with pytest.raises(ConfigError, match="AUTOCOMMIT"):
            check_backend("default")
        with pytest.raises(ConfigError, match="AUTOCOMMIT"):
            IdempotencyMiddleware(lambda request: HttpResponse())
    finally:
        connection.settings_dict["AUTOCOMMIT"] = True


def test_migrate_made_pgonce_tables_and_pgonce_migrate_finds_them_current() -> None:
    assert scalar("SELECT to_regclass('pgonce.keys')::text") == "pgonce.keys"
    out = _command_output("pgonce_migrate")
    assert "up to date" in out


def _command_output(name: str) -> str:
    import io

    buffer = io.StringIO()
    call_command(name, stdout=buffer)
    return buffer.getvalue()


def test_the_claim_runs_on_djangos_own_psycopg_connection() -> None:
    with transaction.atomic():
        assert isinstance(psycopg_connection("default"), psycopg.Connection)
    with pytest.raises(NotInTransaction):
        psycopg_connection("default")


# --- the example project's services and command, as the how-to page shows them -----------------


def test_the_views_payment_and_its_outbox_event_commit_once_with_the_claim(
    client: Client, atomic_requests: bool
) -> None:
    before = scalar("SELECT count(*) FROM pgonce.outbox")
    key = new_key()
    first = post(client, "/payments", key)
    assert post(client, "/payments", key).content == first.content
    payment = Payment.objects.get()
    events = scalar(
        "SELECT count(*) FROM pgonce.outbox WHERE aggregateid = %s AND type = 'payment.created'",
        str(payment.pk),
    )
    assert (events, scalar("SELECT count(*) FROM pgonce.outbox")) == (1, before + 1)


def test_a_failing_view_leaves_neither_payment_nor_event(client: Client) -> None:
    before = scalar("SELECT count(*) FROM pgonce.outbox")
    with transaction.atomic():
        record_payment("alice", 5, "EUR")
        transaction.set_rollback(True)
    assert Payment.objects.count() == 0
    assert scalar("SELECT count(*) FROM pgonce.outbox") == before


def test_process_refunds_handles_each_event_once_and_retries_a_failing_one() -> None:
    paid = Payment.objects.create(principal="alice", amount=1000, currency="EUR")
    # The second refund names a payment that does not exist: its handler fails (the foreign
    # key), its savepoint is rolled back and it waits for its retry; the others commit.
    _deliver(
        {"payment": paid.pk, "amount": 300},
        {"payment": paid.pk + 1000, "amount": 1},
        {"payment": paid.pk, "amount": 200},
        source="refunds",
    )
    out = io.StringIO()
    call_command("process_refunds", stdout=out)
    assert "3 refund event(s) handled" in out.getvalue()
    assert sorted(Refund.objects.values_list("event_id", "amount")) == [
        ("evt-0", 300),
        ("evt-2", 200),
    ]
    call_command("process_refunds", stdout=io.StringIO())  # nothing due: each ran once
    assert Refund.objects.count() == 2
    statuses = {event_id: status for event_id, status, _ in _inbox_rows("refunds")}
    assert statuses == {"evt-0": "done", "evt-1": "pending", "evt-2": "done"}


def test_process_batch_drops_an_older_version_of_an_object_when_asked() -> None:
    versions = [1, 3, 2, 3, 4]
    _deliver(
        *({"version": v} for v in versions),
        source="versions",
        ordering=[Ordering("cus_1", v) for v in versions],
    )
    seen: list[int] = []

    def handler(event: Any) -> None:
        seen.append(event.payload["version"])

    while process_batch("versions", handler, out_of_order="drop"):
        pass
    assert seen == [1, 3, 3, 4]  # the same version is not older; 2 arrived after 3
    statuses = {event_id: status for event_id, status, _ in _inbox_rows("versions")}
    assert statuses["evt-2"] == "skipped"
    assert [statuses[f"evt-{n}"] for n in (0, 1, 3, 4)] == ["done"] * 4
