"""pytest-django, for this package only: Django is configured when these tests are collected.

The rest of the suite never sees a settings module (pytest-django stays idle without one), so
only the tests here get Django's test database (created by ``migrate``, pgonce's migration
included).
"""

from __future__ import annotations

import os

import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.django.settings")
django.setup()
