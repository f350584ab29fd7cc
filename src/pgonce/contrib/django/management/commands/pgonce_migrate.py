"""``manage.py pgonce_migrate [--database default]``: apply pgonce's pending SQL migrations."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandParser

from pgonce.config import DEFAULT_SCHEMA
from pgonce.contrib.django.schema import apply_schema


class Command(BaseCommand):
    help = "Apply pgonce's pending migrations (key store, inbox, outbox) to a Django database."

    def add_arguments(self, parser: CommandParser) -> None:
        pgonce = getattr(settings, "PGONCE", None) or {}
        parser.add_argument("--database", default=pgonce.get("DATABASE", "default"))
        parser.add_argument("--schema", default=pgonce.get("SCHEMA", DEFAULT_SCHEMA))

    def handle(self, *args: Any, **options: Any) -> None:
        applied = apply_schema(
            options["database"],
            options["schema"],
            on_applied=lambda version, name: self.stdout.write(f"applied {version:04d}_{name}"),
        )
        if not applied:
            self.stdout.write("pgonce's schema is up to date")
