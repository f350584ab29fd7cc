"""The test project under a WSGI server (gunicorn)."""

from __future__ import annotations

import os

from django.core.wsgi import get_wsgi_application

os.environ["DJANGO_SETTINGS_MODULE"] = "tests.django.settings"
application = get_wsgi_application()
