"""The operator console: pages for keys, inbox events, outbox rows, rates and health.

:mod:`pgonce.service.admin` holds the routes (and the guard: token, CSRF); this package holds what
they draw: the HTML shell and escaping (:mod:`.html`), the charts (:mod:`.charts`) and the static
files (a stylesheet and a small script for live counts), served by pgonce itself.
"""
