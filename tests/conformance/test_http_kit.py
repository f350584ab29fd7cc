"""The HTTP kit against real servers: pgonce's apps pass it, broken receivers fail where broken."""

from __future__ import annotations

import json
from typing import Any

import pytest

from pgonce.cli import main
from pgonce.conformance import HttpTarget, Report, SqlEffects, UrlEffects, check_http
from pgonce.conformance.runner import client
from tests.conformance.conftest import ALICE, BOB, PAYMENT
from tests.http.conftest import Server


def verdicts(report: Report) -> dict[str, str]:
    return {result.check.name: result.verdict for result in report.results}


def failed(report: Report) -> set[str]:
    return {name for name, verdict in verdicts(report).items() if verdict == "FAIL"}


async def test_the_payments_example_passes(payments_app: Server, dsn: str) -> None:
    target = HttpTarget(
        payments_app.url + "/payments", body=PAYMENT, headers=ALICE, other_headers=BOB
    )
    effects = await SqlEffects.connect(dsn, "SELECT count(*) FROM payments")
    try:
        report = await check_http(target, effects=effects)
    finally:
        await effects.close()
    print(report.table())
    assert report.passed, report.table()
    found = verdicts(report)
    # The example has no endpoint that fails or sets a cookie: those two say so instead.
    assert found.pop("replay-drops-set-cookie") == "SKIP"
    assert found.pop("server-error-not-stored") == "SKIP"
    assert found.pop("in-flight-409") in ("PASS", "SKIP")  # a 409 needs a duplicate in time
    assert set(found.values()) == {"PASS"}, report.table()
    assert report.seconds < 60


def test_the_command_passes_the_test_app_with_every_path(
    test_app: Server, dsn: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CONFORMANCE_AUTH", "Bearer alice-token")
    monkeypatch.setenv("CONFORMANCE_OTHER", "Bearer bob-token")
    monkeypatch.setenv("CONFORMANCE_DSN", dsn)
    code = main(
        [
            "conformance", "http", test_app.url + "/payments",
            "--body", PAYMENT.decode(),
            "--header", "Authorization: env:CONFORMANCE_AUTH",
            "--other-header", "Authorization: env:CONFORMANCE_OTHER",
            "--fail-path", "/fail",
            "--cookie-path", "/cookie",
            "--slow-path", "/slow",
            "--count-sql", "SELECT count(*) FROM payments",
            "--dsn", "env:CONFORMANCE_DSN",
            "--json",
        ]
    )  # fmt: skip
    out = capsys.readouterr().out
    document: dict[str, Any] = json.loads(out)
    assert code == 0, out
    checks = {c["name"]: c for c in document["checks"]}
    assert checks["replay-drops-set-cookie"]["verdict"] == "PASS"
    assert checks["server-error-not-stored"]["verdict"] == "PASS"
    assert checks["in-flight-409"]["verdict"] == "PASS"
    assert all(c["why"] and c["source"] for c in checks.values())
    assert "alice-token" not in out  # credentials are never shown
    assert "bob-token" not in out
    assert dsn not in out


async def test_a_receiver_that_stores_nothing_fails_the_replay_checks(broken: Server) -> None:
    async with client() as http:
        report = await check_http(
            HttpTarget(broken.url + "/nostore/payments", body=PAYMENT),
            effects=UrlEffects(http, broken.url + "/count/nostore"),
            http=http,
        )
    print(report.table())
    assert not report.passed
    assert {
        "replay-identical",
        "replay-keeps-location",
        "concurrent-once",
        "mismatch-other-body",
        "canonical-json-same-request",
        "key-structured-field",
    } <= failed(report), report.table()
    evidence = {r.check.name: r.evidence for r in report.results}
    assert "effects +2 for one operation, not +1" in evidence["replay-identical"]
    assert "effects +50, not +1" in evidence["concurrent-once"]
    assert verdicts(report)["key-empty"] == "PASS"  # only what is broken fails


async def test_a_naive_response_cache_fails_where_it_is_naive(broken: Server) -> None:
    async with client() as http:
        report = await check_http(
            HttpTarget(
                broken.url + "/naive/payments",
                body=PAYMENT,
                other_headers=BOB,
                fail_path="/naive/fail",
                cookie_path="/naive/cookie",
            ),
            effects=UrlEffects(http, broken.url + "/count/naive"),
            http=http,
        )
    print(report.table())
    assert {
        "key-required",
        "key-empty",
        "key-control-characters",
        "replay-drops-set-cookie",
        "mismatch-other-body",
        "mismatch-other-query",
        "concurrent-once",
        "server-error-not-stored",
        "principal-scopes",
        "body-too-large-413",
    } <= failed(report), report.table()
    evidence = {r.check.name: r.evidence for r in report.results}
    assert "the retry of a 5xx was replayed" in evidence["server-error-not-stored"]
    assert "the replay carries Set-Cookie" in evidence["replay-drops-set-cookie"]


def test_an_unreachable_endpoint_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["conformance", "http", "http://127.0.0.1:9/payments", "--budget", "5"])
    err = capsys.readouterr().err
    assert code == 1
    assert err.startswith("pgonce: error: cannot reach http://127.0.0.1:9/payments")
    assert "Traceback" not in err


def test_a_count_sql_without_a_dsn_is_refused(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PGONCE_DSN", raising=False)
    with pytest.raises(SystemExit) as exited:
        main(["conformance", "http", "http://127.0.0.1:9/x", "--count-sql", "SELECT 1"])
    assert exited.value.code == 2  # a usage error, not a failed check
    assert "--count-sql needs --dsn" in capsys.readouterr().err


def test_the_list_names_every_check_with_its_source(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["conformance", "http", "--list"]) == 0
    out = capsys.readouterr().out
    for name in ("key-required", "concurrent-once", "in-flight-409", "safe-methods-untouched"):
        assert name in out
    assert out.count("source:") == 18
