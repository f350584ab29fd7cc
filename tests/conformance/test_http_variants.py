"""The HTTP kit against an endpoint that conforms to the draft in its own way: it must pass."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from pgonce.cli import main
from pgonce.conformance import (
    HttpTarget,
    SqlEffects,
    UrlEffects,
    WebhookTarget,
    check_http,
    check_webhooks,
)
from pgonce.conformance.runner import client
from tests.conformance.conftest import ALICE, APP, BOB, PAYMENT
from tests.http.conftest import Server, start_server
from tests.service.test_serve import SECRET

VARIANTS = (sys.executable, "-m", "bench.servers", "{fd}", "tests.conformance.variants:create_app")


@pytest.fixture
def variants(dsn: str, tmp_path: Path) -> Iterator[Server]:
    server = start_server(dsn, tmp_path / "variants.log", {}, VARIANTS)
    try:
        yield server
    finally:
        server.stop()


@pytest.mark.parametrize("mode", ["plain", "asctime"])
async def test_a_byte_fingerprint_and_no_lifetime_header_pass(variants: Server, mode: str) -> None:
    async with client() as http:
        report = await check_http(
            HttpTarget(f"{variants.url}/{mode}/payments", body=PAYMENT, headers=ALICE,
                       other_headers=BOB),
            effects=UrlEffects(http, variants.url + "/count"),
            http=http,
        )  # fmt: skip
    print(report.table())
    assert report.passed, report.table()
    verdict = {r.check.name: r.verdict for r in report.results}
    evidence = {r.check.name: r.evidence for r in report.results}
    assert verdict["canonical-json-same-request"] == "PASS"
    assert "422" in evidence["canonical-json-same-request"]
    assert verdict["key-lifetime-header"] == ("SKIP" if mode == "plain" else "PASS")


def test_a_password_in_the_url_is_never_printed(
    variants: Server, capsys: pytest.CaptureFixture[str]
) -> None:
    url = variants.url.replace("http://", "http://alice:s3cret-pw@") + "/plain/payments"
    count = variants.url.replace("http://", "http://alice:s3cret-pw@") + "/count"
    for extra in ([], ["--json"]):
        code = main(["conformance", "http", url, "--body", PAYMENT.decode(),
                     "--count-url", count, "--only", "replay-identical", *extra])  # fmt: skip
        out, err = capsys.readouterr()
        assert code == 0, out + err
        assert "s3cret-pw" not in out + err
        assert "alice:***@" in out
    # Nor when the endpoint cannot be judged at all.
    code = main(["conformance", "http", "http://alice:s3cret-pw@127.0.0.1:9/payments"])
    out, err = capsys.readouterr()
    assert code == 1
    assert "s3cret-pw" not in out + err


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("--max-body-bytes", "-1"),
        ("--max-body-bytes", str(10**12)),
        ("--concurrency", "1000000"),
        ("--budget", "nan"),
        ("--budget", "-5"),
    ],
)
def test_an_option_out_of_range_is_refused_before_anything_runs(
    option: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["conformance", "http", "http://127.0.0.1:9/payments", option, value])
    assert exited.value.code == 2
    assert option in capsys.readouterr().err


def test_a_bad_file_or_path_is_one_line_and_sends_nothing(
    variants: Server, capsys: pytest.CaptureFixture[str]
) -> None:
    url = variants.url + "/plain/payments"
    with pytest.raises(SystemExit) as exited:
        main(["conformance", "http", url, "--body-file", "/nonexistent/body.json"])
    err = capsys.readouterr().err
    assert exited.value.code == 2  # usage errors, before anything is sent
    assert err.splitlines()[-1].startswith(
        "pgonce conformance http: error: --body-file: No such file or directory"
    )
    with pytest.raises(SystemExit) as exited:
        main(["conformance", "http", url, "--body", PAYMENT.decode(), "--fail-path", "fail"])
    err = capsys.readouterr().err
    assert exited.value.code == 2
    assert "must be a path on the endpoint's server" in err
    assert httpx.get(variants.url + "/count").json() == {"count": 0}


@pytest.mark.parametrize("check", ["replay-identical", "canonical-json-same-request"])
async def test_two_equal_refusals_are_no_replay(variants: Server, check: str) -> None:
    report = await check_http(
        HttpTarget(f"{variants.url}/limited/payments", body=PAYMENT), only=(check,)
    )
    print(report.table())
    assert not report.passed, report.table()
    assert "429" in report.results[0].evidence


async def test_a_retry_that_waits_for_the_original_and_replays_passes(
    dsn: str, tmp_path: Path
) -> None:
    # pgonce's own middleware with `wait`: a duplicate in flight waits, then gets the replay.
    server = start_server(dsn, tmp_path / "wait.log", {"wait_ms": 5000}, APP)
    effects = await SqlEffects.connect(dsn, "SELECT count(*) FROM payments")
    try:
        report = await check_http(
            HttpTarget(server.url + "/payments", body=PAYMENT, headers=ALICE, slow_path="/slow"),
            effects=effects,
            only=("in-flight-409", "concurrent-once"),
        )
    finally:
        await effects.close()
        server.stop()
    print(report.table())
    assert report.passed, report.table()
    assert report.results[0].verdict == "PASS"
    assert "waited" in report.results[1].evidence


@pytest.mark.parametrize(("mode", "verdict"), [("longkeys", "PASS"), ("truncate", "FAIL"),
                                               ("plain", "PASS")])  # fmt: skip
async def test_a_long_key_may_be_kept_whole_but_never_truncated(
    variants: Server, mode: str, verdict: str
) -> None:
    async with client() as http:
        report = await check_http(
            HttpTarget(f"{variants.url}/{mode}/payments", body=PAYMENT),
            effects=UrlEffects(http, variants.url + "/count"),
            http=http,
            only=("key-too-long",),
        )
    print(report.table())
    assert report.results[0].verdict == verdict, report.table()


def test_a_fixed_key_in_the_headers_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    for option in ("--header", "--other-header"):
        with pytest.raises(SystemExit) as exited:
            main(["conformance", "http", "http://127.0.0.1:9/payments",
                  option, 'idempotency-key: "fixed"'])  # fmt: skip
        assert exited.value.code == 2
        assert "sets Idempotency-Key itself" in capsys.readouterr().err


async def test_a_given_content_type_replaces_the_default(variants: Server) -> None:
    seen: list[list[str]] = []

    async def record(request: httpx.Request) -> None:
        seen.append(request.headers.get_list("content-type"))

    async with client(event_hooks={"request": [record]}) as http:
        await check_http(
            HttpTarget(f"{variants.url}/plain/payments", body=PAYMENT,
                       headers={"Content-Type": "application/json; charset=utf-8"}),
            http=http, only=("replay-identical",),
        )  # fmt: skip
    assert seen
    assert all(types == ["application/json; charset=utf-8"] for types in seen), seen


def test_a_count_query_that_hangs_is_cut_off(
    variants: Server, dsn: str, capsys: pytest.CaptureFixture[str]
) -> None:
    started = time.monotonic()
    code = main(["conformance", "http", variants.url + "/plain/payments",
                 "--body", PAYMENT.decode(), "--budget", "5",
                 "--count-sql", "SELECT count(*) FROM pg_sleep(120)", "--dsn", dsn])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 1
    assert "statement timeout" in err
    assert dsn not in err
    assert time.monotonic() - started < 30


async def test_a_receiver_refusing_bad_signatures_with_400_passes(dsn: str, tmp_path: Path) -> None:
    server = start_server(dsn, tmp_path / "hooks.log", {}, VARIANTS, {"VARIANTS_SECRET": SECRET})
    try:
        async with client() as http:
            report = await check_webhooks(
                WebhookTarget(server.url + "/webhooks/shop", "standard-webhooks", SECRET),
                effects=UrlEffects(http, server.url + "/count/webhooks"),
                http=http,
            )
    finally:
        server.stop()
    print(report.table())
    assert report.passed, report.table()
    assert "answered 400" not in report.table()
    assert "forged-signature-401" in report.table()
