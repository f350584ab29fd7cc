"""The test project under uvicorn: ``python -m bench.servers FD tests.django.asgi:create_app``."""

from __future__ import annotations

import os
from typing import Any


def create_app() -> Any:
    os.environ["DJANGO_SETTINGS_MODULE"] = "tests.django.settings"
    from django.core.asgi import get_asgi_application

    return get_asgi_application()
