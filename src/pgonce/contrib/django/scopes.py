"""Ready-made key scopes for ``PGONCE["SCOPE"]``: whose Idempotency-Key a request carries.

A scope keeps two callers' keys apart: the same key from two callers never meets. Return ``None``
to leave a request unprotected (the view will refuse an anonymous caller itself).
"""

from __future__ import annotations

import hashlib

from django.http import HttpRequest


def user_scope(request: HttpRequest) -> str | None:
    """``user:<pk>`` of the authenticated user (``AuthenticationMiddleware`` must run first)."""
    user = getattr(request, "user", None)
    if user is None or not user.is_authenticated:
        return None
    return f"user:{user.pk}"


def authorization_scope(request: HttpRequest) -> str | None:
    """The SHA-256 of the ``Authorization`` header (an API token), so no credential is stored.

    Use it where the credential is checked by the view (Django REST Framework's token or session
    authentication runs inside the view, after this middleware).
    """
    value = request.META.get("HTTP_AUTHORIZATION")
    if not value:
        return None
    return "authorization:" + hashlib.sha256(value.encode("latin-1")).hexdigest()
