"""ASGI entry point: ``uvicorn examples.django_payments.asgi:application``."""

from __future__ import annotations

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "examples.django_payments.settings")
application = get_asgi_application()
