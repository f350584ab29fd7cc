"""The Django app: ``INSTALLED_APPS = [..., "pgonce.contrib.django"]``."""

from __future__ import annotations

from django.apps import AppConfig


class PgonceConfig(AppConfig):
    name = "pgonce.contrib.django"
    label = "pgonce"
    verbose_name = "pgonce"
