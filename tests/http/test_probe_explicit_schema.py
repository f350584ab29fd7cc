"""A middleware's ``schema`` given explicitly is told from its default: given with a store on
another schema, even when it is pgonce's default name, it is refused at set-up naming both; left
out, the given store's schema is the middleware's."""

from __future__ import annotations

import pytest

from pgonce.errors import UsageError
from tests.http.test_probe_adapters_setup import Build, async_pool, build, sync_pool

__all__ = ["async_pool", "build", "sync_pool"]


@pytest.mark.parametrize("given", ["store", "phases"])
def test_the_default_schema_named_explicitly_against_a_store_on_another_is_refused(
    build: Build, given: str
) -> None:
    store = build.stores[0 if given == "store" else 1](schema="billing")  # type: ignore[attr-defined]
    with pytest.raises(UsageError, match=r"'billing'.*'pgonce'|'pgonce'.*'billing'") as refused:
        build(**{given: store}, schema="pgonce")
    assert f"{given}='billing'" in str(refused.value)
    assert "schema='pgonce'" in str(refused.value)


def test_left_out_the_schema_is_the_given_stores(build: Build) -> None:
    key_store, _ = build.stores  # type: ignore[attr-defined]
    middleware = build(store=key_store(schema="billing"))
    assert (middleware.store.schema, middleware.phases.schema) == ("billing", "billing")


def test_the_default_schema_named_explicitly_with_a_store_on_it_is_taken(build: Build) -> None:
    key_store, _ = build.stores  # type: ignore[attr-defined]
    middleware = build(store=key_store(), schema="pgonce")
    assert (middleware.store.schema, middleware.phases.schema) == ("pgonce", "pgonce")


def test_a_schema_given_alone_builds_both_stores_on_it(build: Build) -> None:
    middleware = build(schema="billing")
    assert (middleware.store.schema, middleware.phases.schema) == ("billing", "billing")
    middleware = build()
    assert (middleware.store.schema, middleware.phases.schema) == ("pgonce", "pgonce")
    assert type(middleware.store.schema) is str


@pytest.mark.parametrize(
    ("schema", "named"),
    [
        (None, "must be a str"),
        (5, "must be a str"),
        ("Billing", "is not allowed"),
        ("pg_billing", "PostgreSQL's own"),
    ],
)
def test_a_schema_pgonce_cannot_have_is_refused_at_set_up(
    build: Build, schema: object, named: str
) -> None:
    # It was taken, and found out at the first request: for a name, as a SchemaNotMigrated
    # telling to run `pgonce migrate`, which refuses that name.
    with pytest.raises(UsageError, match=named):
        build(schema=schema)
