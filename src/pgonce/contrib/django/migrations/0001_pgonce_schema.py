"""pgonce's tables (key store, inbox, outbox) on the database Django migrates.

``manage.py migrate`` runs pgonce's own numbered SQL migrations, in schema ``PGONCE["SCHEMA"]``
(default ``pgonce``): a test database that Django creates gets them too. Later pgonce releases that
add SQL migrations ship a further Django migration calling the same function, and
``manage.py pgonce_migrate`` applies them without waiting for Django's ledger.
"""

from __future__ import annotations

from typing import Any, ClassVar

from django.db import migrations

from pgonce.config import DEFAULT_SCHEMA


def apply(apps: Any, schema_editor: Any) -> None:
    from django.conf import settings

    from pgonce.contrib.django.schema import apply_schema

    schema = (getattr(settings, "PGONCE", None) or {}).get("SCHEMA", DEFAULT_SCHEMA)
    apply_schema(schema_editor.connection.alias, schema)


class Migration(migrations.Migration):
    # pgonce's migrator commits each step itself (on a connection of its own).
    atomic = False
    initial = True
    dependencies: ClassVar[list[tuple[str, str]]] = []
    operations: ClassVar[list[Any]] = [
        migrations.RunPython(apply, migrations.RunPython.noop, elidable=False)
    ]
