"""Settings of the Django payments example.

Run it (PostgreSQL from ``PGONCE_DSN``)::

    export PGONCE_DSN=postgresql://postgres@127.0.0.1:5432/payments
    python -m django migrate --settings examples.django_payments.settings
    gunicorn -k gthread --threads 8 examples.django_payments.wsgi       # WSGI
    uvicorn examples.django_payments.asgi:application                   # or ASGI

    curl -X POST localhost:8000/payments -H 'Authorization: Bearer alice-token' \\
         -H 'Idempotency-Key: "order-42"' -H 'Content-Type: application/json' \\
         -d '{"amount": 1000, "currency": "EUR"}'

Send the same request again: the same 201, byte for byte, marked ``Idempotent-Replayed: true``,
and still one payment. ``migrate`` also created pgonce's tables (the ``pgonce.contrib.django``
app's migration).
"""

from __future__ import annotations

import os
from typing import Any

from psycopg.conninfo import conninfo_to_dict


def database(dsn: str) -> dict[str, Any]:
    """Django's DATABASES entry for a libpq connection string or URL."""
    params = conninfo_to_dict(dsn)
    return {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": params.get("dbname", "postgres"),
        "USER": params.get("user", ""),
        "PASSWORD": params.get("password", ""),
        "HOST": params.get("host", ""),
        "PORT": params.get("port", ""),
        # Keep connections across requests, as a production deployment would.
        "CONN_MAX_AGE": 60,
        "CONN_HEALTH_CHECKS": True,
    }


SECRET_KEY = os.environ.get("DJANGO_SECRET_KEY", "example-only-not-a-secret")
DEBUG = False
ALLOWED_HOSTS = ["127.0.0.1", "localhost", "testserver"]
ROOT_URLCONF = "examples.django_payments.urls"
USE_TZ = True
TIME_ZONE = "UTC"

# --8<-- [start:settings]
INSTALLED_APPS = [
    "django.contrib.contenttypes",
    "django.contrib.auth",
    "rest_framework",
    "pgonce.contrib.django",
    "examples.django_payments.payments",
]

MIDDLEWARE = [
    "django.middleware.common.CommonMiddleware",
    # After whatever the scope function needs (here nothing: it reads the bearer token).
    "pgonce.contrib.django.middleware.IdempotencyMiddleware",
]

DATABASES = {"default": database(os.environ.get("PGONCE_DSN", "dbname=payments"))}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

PGONCE = {
    # Required: whose key a request carries. Here the authenticated principal, so that alice's
    # key never meets bob's (pgonce.contrib.django.scopes has user_scope and authorization_scope).
    "SCOPE": "examples.django_payments.payments.auth.principal_scope",
    # The rest are the defaults, spelled out.
    "DATABASE": "default",  # the alias whose transaction the claim joins
    "SCHEMA": "pgonce",
    "METHODS": ["POST", "PATCH"],
    "REQUIRE_KEY": True,  # 400 for a covered request without a key
    "WAIT": None,  # seconds a duplicate waits for the original; None: 409 at once
    "RETENTION": 86400,  # seconds, advertised in Idempotency-Key-Expires
    "MAX_REQUEST_BYTES": 1048576,
    "MAX_RESPONSE_BYTES": 1048576,
    "CANONICALIZE_JSON": True,  # JSON bodies that differ only in spacing or key order match
    "STORE_SERVER_ERRORS": False,  # a 5xx is rolled back, so the retry runs again
    # pgonce prepares its statements on a connection that reaches PostgreSQL itself (checked
    # once per connection), though Django turns psycopg's preparing off: "none" always,
    # "pgbouncer-transaction" never.
    "POOLER": "auto",
}
# --8<-- [end:settings]

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "examples.django_payments.payments.auth.BearerAuthentication"
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "UNAUTHENTICATED_USER": None,
}
