"""Endpoints that misbehave on purpose: each writes a payment first, then fails in its own way."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

from django.http import HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse

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
