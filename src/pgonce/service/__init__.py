"""The runnable service: configuration, the ASGI app and the background loops of `serve`.

Its running parts (the app, the runner, the metrics, the admin console) need the ``server``
extra, ``pip install 'pgonce[server]'``, and each says so when imported without it. Its
configuration (:mod:`pgonce.service.config`) needs none: the core commands that read a
configuration file (``pgonce migrate``, ``sweep``, ``doctor``) run with the core alone.
"""
