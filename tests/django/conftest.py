"""pytest-django, for this package only: Django is configured when these tests are collected.

The rest of the suite never sees a settings module (pytest-django stays idle without one), so
only the tests here get Django's test database (created by ``migrate``, pgonce's migration
included).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import django
import pytest
from django.db import connection

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.django.settings")
django.setup()


@pytest.fixture(params=[False, True], ids=["autocommit-requests", "atomic-requests"])
def atomic_requests(request: pytest.FixtureRequest) -> Iterator[bool]:
    """Both ways Django runs views: plain, and inside ATOMIC_REQUESTS' atomic() (a savepoint
    within the middleware's transaction then)."""
    previous = connection.settings_dict["ATOMIC_REQUESTS"]
    connection.settings_dict["ATOMIC_REQUESTS"] = request.param
    yield request.param
    connection.settings_dict["ATOMIC_REQUESTS"] = previous
