"""One method or path given where the middleware takes a collection of them: refused at set-up,
not split into its letters (which left every route unprotected, or made every path two-phase)."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi import FastAPI

from pgonce.errors import UsageError
from pgonce.http import IdempotencyMiddleware


class AsyncPool:
    def connection(self) -> Any:
        raise AssertionError("not used at set-up")


def scope_of(scope: Any) -> str:
    return "tenant"


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"methods": "POST"}, "methods"),
        ({"routes": {"/payments": "PUT"}}, "routes['/payments']"),
        ({"two_phase": "/charges"}, "two_phase"),
    ],
)
def test_a_single_name_is_refused(options: dict[str, Any], named: str) -> None:
    with pytest.raises(UsageError) as refused:
        IdempotencyMiddleware(FastAPI(), pool=AsyncPool(), key_scope=scope_of, **options)
    assert str(refused.value).startswith(f"{named} must be a collection of names")


def test_collections_are_taken() -> None:
    middleware = IdempotencyMiddleware(
        FastAPI(),
        pool=AsyncPool(),
        key_scope=scope_of,
        methods=("post",),
        routes={"/payments": ["PUT"], "/off": ()},
        two_phase=["/charges"],
    )
    assert middleware.methods_for("/payments/1") == {"PUT"}
    assert middleware.methods_for("/other") == {"POST"}
    assert middleware.rules.is_two_phase("/charges/1")
    assert not middleware.rules.is_two_phase("/payments")
