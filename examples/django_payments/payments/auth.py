"""Demo credentials: a bearer token names a principal. A real app asks its identity provider."""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest
from rest_framework.authentication import BaseAuthentication

TOKENS = {"alice-token": "alice", "bob-token": "bob"}


def principal_of(authorization: str | None) -> str | None:
    if not authorization or not authorization.startswith("Bearer "):
        return None
    return TOKENS.get(authorization.removeprefix("Bearer "))


def principal_scope(request: HttpRequest) -> str | None:
    """``PGONCE["SCOPE"]``: keys belong to the principal; ``None`` leaves the view to say 401."""
    principal = principal_of(request.META.get("HTTP_AUTHORIZATION"))
    return f"principal:{principal}" if principal else None


class Principal:
    """What DRF's ``request.user`` is here: an authenticated principal, no database row."""

    is_authenticated = True

    def __init__(self, name: str) -> None:
        self.name = name


class BearerAuthentication(BaseAuthentication):
    def authenticate(self, request: Any) -> tuple[Principal, None] | None:
        principal = principal_of(request.META.get("HTTP_AUTHORIZATION"))
        return (Principal(principal), None) if principal else None

    def authenticate_header(self, request: Any) -> str:
        return "Bearer"
