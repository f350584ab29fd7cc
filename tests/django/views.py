"""Endpoints that misbehave on purpose: each writes a payment first, then fails in its own way."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

from django.core.exceptions import PermissionDenied, SuspiciousOperation
from django.db import DatabaseError, IntegrityError, connection, transaction
from django.http import Http404, HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse
from rest_framework.exceptions import ValidationError
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from examples.django_payments.payments.models import Payment
from pgonce.contrib.django.middleware import begin


def insert_payment(amount: int = 1) -> int:
    return int(Payment.objects.create(principal="test", amount=amount, currency="EUR").pk)


def boom(request: HttpRequest) -> HttpResponse:
    insert_payment()
    raise RuntimeError("the endpoint failed after its write")


def fail(request: HttpRequest) -> HttpResponse:
    insert_payment()
    return JsonResponse({"error": "upstream down"}, status=503)


def cookie(request: HttpRequest) -> HttpResponse:
    payment = insert_payment()
    response = JsonResponse({"id": payment}, status=201)
    response["Location"] = f"/payments/{payment}"
    response["X-Custom"] = "kept"
    response.set_cookie("session", "secret-session-id")
    return response


def stream(request: HttpRequest) -> HttpResponse:
    chunks, size = int(request.GET["chunks"]), int(request.GET["size"])
    payment = insert_payment()

    def parts() -> Iterator[bytes]:
        for index in range(chunks):
            yield f"{payment}:{index}:".encode().ljust(size, b".")

    return StreamingHttpResponse(parts(), status=201, content_type="text/plain")


def stream_write(request: HttpRequest) -> HttpResponse:
    # The view runs no query: the generator writes, while Django reads the body.
    def parts() -> Iterator[bytes]:
        yield f"{insert_payment()}".encode()

    return StreamingHttpResponse(parts(), status=201, content_type="text/plain")


#: What each ``kind`` of raise_after_write raises; Django answers 404, 403 and 400 for them.
RAISED: dict[str, type[Exception]] = {
    "404": Http404,
    "403": PermissionDenied,
    "400": SuspiciousOperation,
}


def raise_after_write(request: HttpRequest) -> HttpResponse:
    insert_payment()
    raise RAISED[request.GET["kind"]]("refused after the write")


class RaiseAfterWriteDRF(APIView):
    """DRF turns the exception into a Response inside the view: the view's own answer."""

    authentication_classes = ()
    permission_classes = ()

    def post(self, request: Request) -> Response:
        insert_payment()
        raise ValidationError({"amount": ["too late to refuse"]})


def lose_connection(request: HttpRequest) -> HttpResponse:
    payment = insert_payment()
    if request.GET.get("lose"):
        # The server ends the session as a failover or a restart would, mid-transaction.
        with connection.cursor() as cur:
            cur.execute("SELECT pg_terminate_backend(pg_backend_pid())")
    return JsonResponse({"id": payment}, status=201)


def no_db(request: HttpRequest) -> HttpResponse:
    begin(request)
    return JsonResponse({"nonce": uuid.uuid4().hex}, status=201)


def block(request: HttpRequest) -> HttpResponse:
    # Signals "my write is done" with a file, then holds the transaction open until the test
    # creates the gate file (or kills the server). Every run leaves a line in "runs".
    payment = insert_payment()
    folder = Path(request.GET["directory"])
    with (folder / "runs").open("a") as runs:
        runs.write(f"{payment}\n")
    (folder / "started").write_text(str(os.getpid()))
    deadline = time.monotonic() + 60
    while not (folder / "gate").exists():
        if time.monotonic() > deadline:
            return JsonResponse({"error": "gate never opened"}, status=500)
        time.sleep(0.01)
    return JsonResponse({"id": payment}, status=int(request.GET.get("status", 201)))


def swallow_db_error(request: HttpRequest) -> HttpResponse:
    # Catches its own failed statement outside any atomic() block of its own and answers: the
    # transaction is aborted, so its write cannot commit and its answer must not be stored.
    insert_payment()
    try:
        with connection.cursor() as cur:
            cur.execute("SELECT 1 / 0")
    except DatabaseError:
        return JsonResponse({"error": "conflict"}, status=409)
    return JsonResponse({"error": "unreachable"}, status=500)


def rollback_and_write_anew(request: HttpRequest) -> HttpResponse:
    # Misuse: ends the request's transaction on the psycopg connection itself (the claim goes
    # with it), then writes in a new one, which the middleware's commit finds and rolls back.
    begin(request)
    connection.connection.rollback()
    return JsonResponse({"id": insert_payment()}, status=201)


#: What the on_commit hooks of ``committed_hook`` ran for, in order.
COMMITTED: list[int] = []


def committed_hook(request: HttpRequest) -> HttpResponse:
    payment = insert_payment()
    transaction.on_commit(lambda: COMMITTED.append(payment))
    return JsonResponse({"id": payment}, status=int(request.GET.get("status", 201)))


def database_scope(request: HttpRequest) -> str:
    # A key scope that reads the database, as user_scope does to load the session's user.
    with connection.cursor() as cur:
        cur.execute("SELECT 'db-user'")
        row = cur.fetchone()
    return f"user:{row[0] if row else None}"


def mark_for_rollback(request: HttpRequest) -> HttpResponse:
    # Undoes its write and answers 200 (Django's documented way): under ATOMIC_REQUESTS the mark
    # is on the request's atomic() block, else on the middleware's own.
    insert_payment()
    transaction.set_rollback(True)
    return JsonResponse({"saved": False}, status=200)


def mark_own_block_for_rollback(request: HttpRequest) -> HttpResponse:
    # The same inside the view's own atomic() block: without the middleware, the whole
    # transaction of a view under autocommit.
    with transaction.atomic():
        insert_payment()
        transaction.set_rollback(True)
    return JsonResponse({"saved": False}, status=200)


def undo_a_part_then_write(request: HttpRequest) -> HttpResponse:
    # A partial undo (get_or_create's way): a block rolled back by the exception the view
    # catches, then a write that commits with the stored answer.
    try:
        with transaction.atomic():
            insert_payment()
            raise IntegrityError("taken")
    except IntegrityError:
        pass
    return JsonResponse({"id": insert_payment()}, status=201)


def commit_the_request(request: HttpRequest) -> HttpResponse:
    # Misuse: commits the request's transaction (the claim with it) before the answer is stored.
    payment = insert_payment()
    if request.GET.get("how") == "autocommit-off":
        transaction.set_autocommit(False)
    connection.commit()
    return JsonResponse({"id": payment}, status=201)


def end_on_psycopg(request: HttpRequest) -> HttpResponse:
    # Misuse: ends the request's transaction on the psycopg connection itself (the claim with
    # it) and runs nothing after.
    payment = insert_payment()
    getattr(connection.connection, request.GET["action"])()
    return JsonResponse({"id": payment}, status=201)


#: What the on_commit hooks of ``hook_without_query`` ran for, in order.
HOOKED: list[str] = []


def hook_without_query(request: HttpRequest) -> HttpResponse:
    # Its one effect is an on_commit hook (an e-mail, a task): it runs no query.
    nonce = uuid.uuid4().hex
    transaction.on_commit(lambda: HOOKED.append(nonce))
    return JsonResponse({"nonce": nonce}, status=201)


def durable_block(request: HttpRequest) -> HttpResponse:
    # A durable block must be the outermost: Django refuses it inside the middleware's.
    with transaction.atomic(durable=True):
        payment = insert_payment()
    return JsonResponse({"id": payment}, status=201)


def broken_reference(request: HttpRequest) -> HttpResponse:
    # A refund of a payment that does not exist: Django's foreign keys are deferred, so the
    # violation surfaces at COMMIT only.
    from examples.django_payments.payments.models import Refund

    insert_payment()
    Refund.objects.create(event_id=uuid.uuid4().hex, payment_id=-1, amount=1)
    return JsonResponse({"saved": True}, status=201)


def no_savepoint_caught(request: HttpRequest) -> HttpResponse:
    # atomic(savepoint=False) inside the request's transaction: an error in it marks the whole
    # transaction for rollback, which the view catches and answers.
    insert_payment()
    try:
        with transaction.atomic(savepoint=False), connection.cursor() as cur:
            cur.execute("SELECT 1 / 0")
    except DatabaseError:
        return JsonResponse({"error": "caught"}, status=409)
    return JsonResponse({"error": "unreachable"}, status=500)
