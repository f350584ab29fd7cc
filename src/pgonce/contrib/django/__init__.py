"""pgonce for Django: the Idempotency-Key middleware, the schema through ``migrate``, and the
outbox and inbox on the ORM's own connection (install the extra: ``pip install pgonce[django]``).

Add ``"pgonce.contrib.django"`` to ``INSTALLED_APPS`` and
``"pgonce.contrib.django.middleware.IdempotencyMiddleware"`` to ``MIDDLEWARE``; settings live in
``settings.PGONCE`` (:mod:`pgonce.contrib.django.conf`). Everything runs on Django's own psycopg 3
connection and inside ``transaction.atomic()``: the claim of a key, the view's ORM writes, the
stored response and outbox rows commit in one transaction, or not at all.

Nothing here is imported by ``import pgonce``; the module names below are the public API.
"""

from pgonce.extras import require

# Every part of the app imports Django: one check at its door names the extra to install, rather
# than a bare "No module named 'django'" from whichever part was imported first.
require("django", "pgonce.contrib.django")
