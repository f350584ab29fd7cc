"""Every framework adapter passes the kit, through its real server (tests/adapters/conftest.py):
the black-box twin of tests/adapters/test_conformance.py."""

from __future__ import annotations

import pytest

from pgonce.conformance import HttpTarget, SqlEffects, check_http
from tests.adapters.conftest import adapter, app_dsn, make_server, server
from tests.conformance.conftest import ALICE, BOB, PAYMENT
from tests.http.conftest import Server

__all__ = ["adapter", "app_dsn", "make_server", "server"]  # the adapters' fixtures, reused


@pytest.mark.slow
async def test_every_adapter_passes_the_kit(server: Server, app_dsn: str) -> None:
    target = HttpTarget(
        server.url + "/payments",
        body=PAYMENT,
        headers=ALICE,
        other_headers=BOB,
        fail_path="/fail",
        cookie_path="/cookie",
    )
    effects = await SqlEffects.connect(app_dsn, "SELECT count(*) FROM payments")
    try:
        report = await check_http(target, effects=effects)
    finally:
        await effects.close()
    assert report.passed, report.table()
    skipped = {r.check.name for r in report.results if r.verdict == "SKIP"}
    assert skipped <= {"in-flight-409"}, report.table()  # no --slow-path on these apps
