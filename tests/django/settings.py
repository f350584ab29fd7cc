"""The payments example's settings for the tests: the example's views plus misbehaving ones.

In a server process the database comes from ``PGONCE_TEST_HTTP_DSN`` and the middleware's
options from ``PGONCE_TEST_HTTP_OPTIONS`` (JSON, the keys of ``settings.PGONCE`` in lower case);
in pytest-django's own process, from ``PGONCE_TEST_DSN`` (pytest-django creates the test database
and runs ``migrate`` on it, pgonce's migration included).
"""

from __future__ import annotations

import json
import os

from examples.django_payments.settings import *  # noqa: F403
from examples.django_payments.settings import PGONCE, database

ROOT_URLCONF = "tests.django.urls"

if os.environ.get("PGONCE_TEST_HTTP_DSN"):
    DATABASES = {"default": database(os.environ["PGONCE_TEST_HTTP_DSN"])}
else:
    DATABASES = {
        "default": {
            **database(os.environ.get("PGONCE_TEST_DSN", "dbname=postgres")),
            "CONN_MAX_AGE": 0,
            "TEST": {"NAME": "pgonce_django_test"},
        },
        # Not PostgreSQL: pgonce must refuse it clearly.
        "sqlite": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"},
    }

_options = json.loads(os.environ.get("PGONCE_TEST_HTTP_OPTIONS") or "{}")
if "wait_ms" in _options:
    _options["wait"] = _options.pop("wait_ms") / 1000
PGONCE = {**PGONCE, **{name.upper(): value for name, value in _options.items()}}
