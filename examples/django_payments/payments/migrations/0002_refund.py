"""The refunds table, written by the ``refunds`` inbox handler."""

from __future__ import annotations

from typing import Any, ClassVar

import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies: ClassVar[list[tuple[str, str]]] = [("payments", "0001_initial")]
    operations: ClassVar[list[Any]] = [
        migrations.CreateModel(
            name="Refund",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False)),
                ("event_id", models.TextField(unique=True)),
                ("amount", models.BigIntegerField()),
                (
                    "payment",
                    models.ForeignKey(
                        on_delete=django.db.models.deletion.PROTECT, to="payments.payment"
                    ),
                ),
            ],
            options={"db_table": "refunds"},
        ),
    ]
