"""WSGI entry point: ``gunicorn examples.django_payments.wsgi``."""

from __future__ import annotations

import os

from django.core.wsgi import get_wsgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "examples.django_payments.settings")
application = get_wsgi_application()
