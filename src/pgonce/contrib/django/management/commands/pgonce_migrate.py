"""``manage.py pgonce_migrate [--database default]``: apply pgonce's pending SQL migrations."""

from __future__ import annotations

from typing import Any

import psycopg
from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import connections
from django.utils.connection import ConnectionDoesNotExist

from pgonce.config import DEFAULT_SCHEMA
from pgonce.contrib.django.schema import apply_schema
from pgonce.errors import ConfigError, DatabaseError


class Command(BaseCommand):
    help = "Apply pgonce's pending migrations (key store, inbox, outbox) to a Django database."

    def add_arguments(self, parser: CommandParser) -> None:
        pgonce = getattr(settings, "PGONCE", None) or {}
        # An alias settings.DATABASES does not define is refused by the parser, as Django's
        # own migrate refuses it: a message, not a traceback.
        parser.add_argument(
            "--database", default=pgonce.get("DATABASE", "default"), choices=tuple(connections)
        )
        parser.add_argument("--schema", default=pgonce.get("SCHEMA", DEFAULT_SCHEMA))

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            applied = apply_schema(
                options["database"],
                options["schema"],
                on_applied=lambda version, name: self.stdout.write(f"applied {version:04d}_{name}"),
            )
        except (
            ConfigError,
            ConnectionDoesNotExist,
            DatabaseError,
            psycopg.OperationalError,
        ) as error:
            # What is wrong with the settings, the schema's name or the database (it cannot be
            # reached): said on one line, exit status 1, no traceback; nothing was applied
            # past the last migration reported.
            raise CommandError(f"pgonce_migrate: {error}") from error
        if not applied:
            self.stdout.write("pgonce's schema is up to date")
