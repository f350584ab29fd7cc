"""The webhook kit against real receivers: ``pgonce serve`` passes it for every provider scheme,
and the broken receivers fail exactly where they are broken."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest

from pgonce.cli import main
from pgonce.conformance import Report, SqlEffects, UrlEffects, WebhookTarget, check_webhooks
from pgonce.conformance.runner import client
from pgonce.service.demo import SETUP
from tests.conformance.conftest import BROKEN_SECRET
from tests.http.conftest import Server
from tests.service.test_serve import SECRET, Service, start

#: One service, one source per scheme, each with the demo handler (a row per handled event).
CONFIG = """
[server]
log_format = "json"
[inbox]
workers = 2
[sources.shop]
scheme = "standard-webhooks"
secrets = ["env:TEST_SHOP_SECRET"]
handler = "pgonce.service.demo:record_order"
[sources.pay]
scheme = "stripe"
secrets = ["env:TEST_PAY_SECRET"]
handler = "pgonce.service.demo:record_order"
[sources.chat]
scheme = "slack"
secrets = ["env:TEST_CHAT_SECRET"]
handler = "pgonce.service.demo:record_order"
[sources.gh]
scheme = "github"
secrets = ["env:TEST_GH_SECRET"]
handler = "pgonce.service.demo:record_order"
"""
SECRETS = {
    "shop": ("standard-webhooks", SECRET),
    "pay": ("stripe", "whsec_test_secret_for_the_kit"),
    "chat": ("slack", "8f742231b10e8888abcd99yyyzzz85a5"),
    "gh": ("github", "a-github-test-secret"),
}


def count_sql(source: str) -> str:
    return f"SELECT count(*) FROM pgonce_demo.webhook_orders WHERE source = '{source}'"


def verdicts(report: Report) -> dict[str, str]:
    return {result.check.name: result.verdict for result in report.results}


@pytest.fixture
def service(dsn: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Service]:
    with psycopg.connect(dsn) as conn:
        conn.execute(SETUP)
    for source, (_, secret) in SECRETS.items():
        monkeypatch.setenv(f"TEST_{source.upper()}_SECRET", secret)
    running = start(dsn, tmp_path, CONFIG)
    try:
        yield running
    finally:
        if running.process.poll() is None:
            running.stop()


def test_the_command_passes_pgonce_serve(
    service: Service, dsn: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CONFORMANCE_DSN", dsn)
    code = main(
        [
            "conformance", "webhooks", service.url + "/webhooks/shop",
            "--scheme", "standard-webhooks",
            "--secret", "env:TEST_SHOP_SECRET",
            "--count-sql", count_sql("shop"),
            "--dsn", "env:CONFORMANCE_DSN",
            "--json",
        ]
    )  # fmt: skip
    out = capsys.readouterr().out
    document: dict[str, Any] = json.loads(out)
    assert code == 0, out
    found = {c["name"]: c["verdict"] for c in document["checks"]}
    assert set(found.values()) == {"PASS"}, out  # the provider's own library included
    assert SECRET not in out
    assert SECRET.removeprefix("whsec_") not in out


async def test_every_provider_scheme_of_pgonce_serve_passes(service: Service, dsn: str) -> None:
    for source in ("pay", "chat", "gh"):
        scheme, secret = SECRETS[source]
        effects = await SqlEffects.connect(dsn, count_sql(source))
        try:
            report = await check_webhooks(
                WebhookTarget(f"{service.url}/webhooks/{source}", scheme, secret, settle=0.2),
                effects=effects,
            )
        finally:
            await effects.close()
        print(report.table())
        assert report.passed, report.table()
        found = verdicts(report)
        if scheme == "github":  # no timestamp is signed, and GitHub publishes no signer
            for name in (
                "provider-library-accepted",
                "stale-timestamp-401",
                "future-timestamp-401",
            ):
                assert found.pop(name) == "SKIP"
        assert set(found.values()) == {"PASS"}, report.table()


async def broken_report(broken: Server, mode: str) -> Report:
    async with client() as http:
        return await check_webhooks(
            WebhookTarget(
                f"{broken.url}/{mode}/webhooks/shop",
                "standard-webhooks",
                BROKEN_SECRET,
                tolerance=timedelta(minutes=5),
                max_body_bytes=64 * 1024,
                settle=0.2,
                effect_timeout=2,
            ),
            effects=UrlEffects(http, f"{broken.url}/count/{mode}"),
            http=http,
        )


async def test_a_receiver_verifying_a_reserialized_body_fails(broken: Server) -> None:
    report = await broken_report(broken, "reserialize")
    print(report.table())
    found = verdicts(report)
    for name in (
        "signed-accepted",
        "provider-library-accepted",
        "non-utf8-body-4xx",
        "malformed-json-4xx",
        "retry-storm-one-effect",
        "errors-problem-json",
    ):
        assert found[name] == "FAIL", report.table()
    evidence = {r.check.name: r.evidence for r in report.results}
    assert "answered 401" in evidence["signed-accepted"]
    assert "answered 500" in evidence["malformed-json-4xx"]


async def test_a_receiver_without_dedupe_or_tolerance_fails(broken: Server) -> None:
    report = await broken_report(broken, "nodedupe")
    print(report.table())
    found = verdicts(report)
    for name in (
        "stale-timestamp-401",
        "future-timestamp-401",
        "oversized-body-413",
        "unknown-source-404",
        "same-id-other-body-409",
        "retry-storm-one-effect",
        "refusals-no-effect",
    ):
        assert found[name] == "FAIL", report.table()
    for name in ("signed-accepted", "forged-signature-401", "missing-signature-401"):
        assert found[name] == "PASS", report.table()
    evidence = {r.check.name: r.evidence for r in report.results}
    assert "effects +20, not +1" in evidence["retry-storm-one-effect"]


def test_a_secret_is_read_from_the_environment_only(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(
            [
                "conformance", "webhooks", "http://127.0.0.1:9/webhooks/shop",
                "--scheme", "stripe", "--secret", "whsec_literal_value",
            ]
        )  # fmt: skip
    err = capsys.readouterr().err
    assert exited.value.code == 2
    assert "read from the environment only" in err
    assert "whsec_literal_value" not in err
