"""The Django payments app of the Django benchmark, served by gunicorn (``bench.django_app``).

One module is the settings, the URLconf and the WSGI application. ``BENCH_DJANGO_VARIANT`` is
``none`` (the app alone), ``atomic`` (the app alone with ``ATOMIC_REQUESTS``: its INSERT in a
transaction of its own), ``pgonce`` (the same app behind pgonce's Idempotency-Key middleware),
``statements`` (the same app between the key store's begin() and commit() in an ``atomic()``
block, :class:`StatementsAlone`) or ``hand`` (the app doing pgonce's writes itself in its own
``atomic()`` block, :mod:`bench.by_hand`);
``BENCH_HTTP_DSN`` is the database. The view inserts one row with the ORM and answers 201 with JSON.
"""

from __future__ import annotations

import json
import os
from typing import Any

import django
from django.conf import settings
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.urls import path

import pgonce
from bench import by_hand
from pgonce import KeyStore, Won, fingerprint

TABLE = "bench_django_payments"
SCOPE = "bench-django:bench"
_FLOOR_FP = fingerprint("POST", "/payments", b"")


def scope(request: HttpRequest) -> str:
    return SCOPE


class StatementsAlone:
    """The key store's statements alone around a Django view: the floor of the one-transaction
    design under Django.

    What pgonce's middleware does in the database, with none of its logic: ``atomic()`` on
    Django's connection, begin() with a fixed fingerprint (BEGIN with the claim), the view, then
    commit() with the view's response (the completion with COMMIT; Django's COMMIT at the end of
    the block then finds the transaction over); a replay answers the stored response. No key
    validation, scope, request fingerprint, size limits, problem answers or expiry header. What
    separates it from Django + pgonce is the middleware's own Python; what separates it from
    Django alone is the transaction and the database work the one-transaction design needs.
    """

    def __init__(self, get_response: Any) -> None:
        self.get_response = get_response
        # As the middleware's store on a connection that reaches PostgreSQL itself: Django turns
        # psycopg's preparing off, and the key store prepares its statements anyway.
        self.store = KeyStore(pooler="none")

    def __call__(self, request: HttpRequest) -> HttpResponse:
        from django.db import connection, transaction

        key = request.META["HTTP_IDEMPOTENCY_KEY"]
        with transaction.atomic():
            conn = connection.connection  # atomic() connected it
            claim = self.store.begin(conn, SCOPE, key, _FLOOR_FP)
            if isinstance(claim, Won):
                response: HttpResponse = self.get_response(request)
                answer = pgonce.Response(
                    response.status_code, tuple(response.items()), response.content
                )
                self.store.commit(conn, claim, answer)
                return response
            transaction.set_rollback(True)  # begin() has already ended its transaction
        assert isinstance(claim, pgonce.Replay)
        stored = claim.response
        return HttpResponse(stored.body, status=stored.status)


def create_app() -> Any:
    """Configure Django for ``BENCH_DJANGO_VARIANT`` and return the WSGI application
    (gunicorn's ``bench.django_app:create_app()``)."""
    from psycopg.conninfo import conninfo_to_dict

    params = conninfo_to_dict(os.environ["BENCH_HTTP_DSN"])
    variant = os.environ.get("BENCH_DJANGO_VARIANT", "none")
    middleware = []
    if variant == "pgonce":
        middleware.append("pgonce.contrib.django.middleware.IdempotencyMiddleware")
    elif variant == "statements":
        middleware.append(f"{__name__}.StatementsAlone")
    settings.configure(
        DEBUG=False,
        SECRET_KEY="bench-only",
        ALLOWED_HOSTS=["*"],
        ROOT_URLCONF=__name__,
        USE_TZ=True,
        INSTALLED_APPS=["pgonce.contrib.django"],
        MIDDLEWARE=middleware,
        DATABASES={
            "default": {
                "ENGINE": "django.db.backends.postgresql",
                "NAME": params.get("dbname", ""),
                "USER": params.get("user", ""),
                "PASSWORD": params.get("password", ""),
                "HOST": params.get("host", ""),
                "PORT": params.get("port", ""),
                "CONN_MAX_AGE": None,  # one connection per thread, kept: as a deployment would
                "ATOMIC_REQUESTS": variant == "atomic",
            }
        },
        PGONCE={"SCOPE": f"{__name__}.scope"},
    )
    django.setup()
    from django.core.wsgi import get_wsgi_application
    from django.db import connection, models, transaction

    class Payment(models.Model):  # type: ignore[misc]
        principal = models.TextField()
        amount = models.BigIntegerField()
        currency = models.TextField()

        class Meta:
            app_label = "pgonce"
            db_table = TABLE
            managed = False

    def create_payment(request: HttpRequest) -> HttpResponse:
        data = json.loads(request.body)
        if variant == "hand":
            return by_hand_payment(request, data)
        payment = Payment.objects.create(
            principal="bench", amount=data["amount"], currency=data["currency"]
        )
        body = {"id": payment.pk, "amount": payment.amount, "currency": payment.currency}
        return JsonResponse(body, status=201, headers={"Location": f"/payments/{payment.pk}"})

    def by_hand_payment(request: HttpRequest, data: dict[str, Any]) -> HttpResponse:
        key = request.headers["Idempotency-Key"]
        with transaction.atomic():
            # As pgonce's middleware does: BEGIN with the claim, the completion with COMMIT
            # (Django's own COMMIT at the block's end then finds the transaction over).
            conn = connection.connection
            by_hand.claim(conn, SCOPE, key)
            payment = Payment.objects.create(
                principal="bench", amount=data["amount"], currency=data["currency"]
            )
            body = {"id": payment.pk, "amount": payment.amount, "currency": payment.currency}
            encoded = json.dumps(body).encode()
            by_hand.complete(conn, SCOPE, key, 201, encoded)
        headers = {"Location": f"/payments/{payment.pk}"}
        return HttpResponse(encoded, status=201, headers=headers, content_type="application/json")

    urlpatterns.append(path("payments", create_payment))
    return get_wsgi_application()


urlpatterns: list[Any] = []
