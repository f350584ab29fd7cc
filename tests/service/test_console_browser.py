"""The operator console in headless Chromium, against the real ``pgonce serve`` process.

Every page loads without a console error (a Content-Security-Policy violation is one); the keys
search pages by keyset and a key's stored response is shown byte for byte; hostile bodies (script
tags, a megabyte, bytes that are not UTF-8) are shown as inert text; the events and outbox filters
narrow their listings; a bulk replay of dead letters, confirmed, reaches a worker and the events
are done, once; a parked outbox row replayed from its page is due again.

With ``PGONCE_CONSOLE_SCREENSHOTS`` set to a folder (``tools/console_screenshots.py`` sets it to
``docs/assets/console``), each page is also saved there as a PNG for the documentation.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import psycopg
import pytest
from psycopg.types.json import Jsonb

from pgonce.service.admin import AdminAuth
from tests.service.handlers import FIX
from tests.service.test_admin_browser import (  # noqa: F401 (fixtures)
    browser,
    deliver,
    effects,
    service,
    status_of,
    wait_until,
)
from tests.service.test_serve import TOKEN, Service

if TYPE_CHECKING:
    from playwright.sync_api import Browser, Page

SHOTS = os.environ.get("PGONCE_CONSOLE_SCREENSHOTS")

#: A stored JSON response with the whitespace and key order a client saw: shown exactly.
EXACT_BODY = b'{"id": "ord_1",   "amount":12,\n  "note": "caf\xc3\xa9 & <b>bold</b>"}'
HOSTILE = b'<script>window.__pwned = 1</script><img src=x onerror="window.__pwned = 2">'
NOT_UTF8 = b"ok \xff\xfe\x80 end"
HUGE = b"x" * (1024 * 1024)


def is_status(dsn: str, event_id: str, wanted: str) -> bool:
    return status_of(dsn, "flaky", event_id) == wanted


def seed(dsn: str) -> None:
    """Keys, inbox history and outbox rows of the last hour, so that every page has rows."""
    with psycopg.connect(dsn) as conn:
        conn.execute(
            """INSERT INTO pgonce.keys (scope, key, fingerprint, claimed_at, completed_at,
                                        response_status, response_headers, response_body)
               SELECT 'api', 'order-' || lpad(g::text, 3, '0'), sha256(g::text::bytea),
                      now() - g * interval '50 seconds', now() - g * interval '50 seconds',
                      201, '[["content-type", "application/json"]]', '{"ok": true}'
                 FROM generate_series(1, 70) AS g"""
        )
        for key, body, headers in [
            ("exact", EXACT_BODY, [["content-type", "application/json"], ["x-trace", "a<b>"]]),
            ("hostile", HOSTILE, [["content-type", "text/html"]]),
            ("binary", NOT_UTF8, [["content-type", "application/octet-stream"]]),
            ("huge", HUGE, [["content-type", "text/plain"]]),
        ]:
            conn.execute(
                """INSERT INTO pgonce.keys (scope, key, fingerprint, claimed_at, completed_at,
                                            response_status, response_headers, response_body)
                   VALUES ('audit', %s, sha256(%s), now(), now(), 200, %s, %s)""",
                (key, key.encode(), Jsonb(headers), body),
            )
        conn.execute(
            """INSERT INTO pgonce.inbox (source, event_id, body, headers, digest, received_at,
                                         status, next_attempt_at, processed_at, attempts,
                                         last_error)
               SELECT 'shop', 'hist_' || g, '{"type": "order.created"}', '{}',
                      sha256(g::text::bytea), now() - g * interval '20 seconds',
                      CASE WHEN g % 9 = 0 THEN 'skipped' ELSE 'done' END, now(),
                      now() - g * interval '20 seconds' + interval '2 seconds', 0, NULL
                 FROM generate_series(1, 150) AS g"""
        )
        conn.execute(
            """INSERT INTO pgonce.inbox (source, event_id, body, headers, digest, received_at,
                                         status, next_attempt_at, processed_at, attempts,
                                         last_error)
               VALUES ('flaky', 'evt_hostile', %s, %s, sha256(%s), now() - interval '5 minutes',
                       'dead', now(), now(), 1, %s)""",
            (
                HOSTILE + b"\xff",
                Jsonb({"webhook-id": "<script>window.__pwned = 3</script>"}),
                HOSTILE,
                "RuntimeError: <script>window.__pwned = 4</script>",
            ),
        )
        conn.execute(
            """INSERT INTO pgonce.outbox (aggregatetype, aggregateid, type, payload, created_at,
                                          published_at, parked_at, attempts, last_error,
                                          next_attempt_at)
               SELECT CASE WHEN g % 2 = 0 THEN 'order' ELSE 'invoice' END, (g % 7)::text,
                      'order.created', jsonb_build_object('n', g),
                      now() - g * interval '30 seconds',
                      CASE WHEN g % 10 > 1 THEN now() - g * interval '30 seconds'
                                                + interval '1 second' END,
                      CASE WHEN g % 10 = 1 THEN now() END,
                      CASE WHEN g % 10 = 1 THEN 5 ELSE 0 END,
                      CASE WHEN g % 10 = 1 THEN 'broker refused: <b>no route</b>' END,
                      now()
                 FROM generate_series(1, 100) AS g"""
        )


@pytest.fixture
def console(service: Service, browser: Browser) -> Iterator[tuple[Page, list[str]]]:  # noqa: F811
    """A logged-in page, and the console errors and page errors it collects."""
    context = browser.new_context(
        http_credentials={"username": "admin", "password": TOKEN},
        viewport={"width": 1280, "height": 900},
    )
    page = context.new_page()
    errors: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    yield page, errors
    context.close()


def visit(page: Page, url: str, shot: str | None = None) -> None:
    response = page.goto(url)
    assert response is not None
    assert response.status == 200, url
    csp = response.headers["content-security-policy"]
    assert "script-src 'self'" in csp
    assert "unsafe-inline" not in csp
    page.wait_for_load_state("load")
    if shot and SHOTS:
        Path(SHOTS).mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(Path(SHOTS) / f"{shot}.png"), full_page=False)


def inert(page: Page) -> None:
    """Nothing of a hostile body ran or became markup."""
    assert page.evaluate("window.__pwned") is None
    assert page.locator("main script").count() == 0
    assert page.locator("main img").count() == 0


def test_every_page_loads_clean_and_shows_bodies_inert(
    dsn: str,
    service: Service,  # noqa: F811
    console: tuple[Page, list[str]],
) -> None:
    seed(dsn)
    page, errors = console
    url = service.url

    visit(page, f"{url}/admin", "overview")
    assert page.locator("figure svg").count() == 5
    assert page.locator("[data-live=outbox_parked]").inner_text() == "10"
    visit(page, f"{url}/admin?window=day")

    # Keys: a prefix search pages by keyset, 50 and then the rest, without overlap.
    visit(page, f"{url}/admin/keys")
    page.fill("input[name=scope]", "api")
    page.fill("input[name=prefix]", "order-")
    page.get_by_role("button", name="search").click()
    page.wait_for_url("**/admin/keys?*")
    first = page.locator("table tr td:first-child").all_inner_texts()
    assert len(first) == 50
    assert first[0] == "order-001"
    if SHOTS:
        page.screenshot(path=str(Path(SHOTS) / "keys.png"))
    page.get_by_role("link", name="next page →").click()
    page.wait_for_url("**after=order-050*")
    rest = page.locator("table tr td:first-child").all_inner_texts()
    assert rest == [f"order-{n:03d}" for n in range(51, 71)]
    visit(page, f"{url}/admin/keys?scope=api&prefix=order-07")
    assert page.locator("table tr td:first-child").all_inner_texts() == ["order-070"]

    # A key's stored response, byte for byte, and its headers in order.
    visit(page, f"{url}/admin/key?scope=audit&key=exact", "key")
    assert page.locator("pre.body").text_content() == EXACT_BODY.decode()
    assert page.locator("pre.headers").text_content() == (
        "content-type: application/json\nx-trace: a<b>"
    )
    assert json.loads(page.locator("pre.json").text_content() or "") == json.loads(EXACT_BODY)
    assert "fingerprint" in page.inner_text("main")
    visit(page, f"{url}/admin/key?scope=audit&key=hostile")
    assert page.locator("pre.body").text_content() == HOSTILE.decode()
    inert(page)
    visit(page, f"{url}/admin/key?scope=audit&key=binary")
    assert page.locator("pre.body").text_content() == "ok \\xff\\xfe\\x80 end"
    assert "not valid UTF-8" in page.inner_text("main")
    visit(page, f"{url}/admin/key?scope=audit&key=huge")
    assert f"{len(HUGE) - 64 * 1024:,} more bytes not shown" in page.inner_text("main")
    assert len(page.locator("pre.body").text_content() or "") == 64 * 1024

    # Events: filters, and a hostile dead letter shown inert.
    visit(page, f"{url}/admin/events", "events")
    assert page.get_by_role("link", name="evt_hostile").count() == 1
    page.select_option("select[name=status]", "dead")
    page.get_by_role("button", name="filter").click()
    page.wait_for_url("**status=dead*")
    assert page.locator("table tr td:nth-child(3)").all_inner_texts() == ["evt_hostile"]
    visit(page, f"{url}/admin/events?status=skipped&source=shop")
    statuses = set(page.locator("table tr td:nth-child(4)").all_inner_texts())
    assert statuses == {"skipped"}
    visit(page, f"{url}/admin/events?id=hist_7")
    assert page.locator("table tr td:nth-child(3)").all_inner_texts() == ["hist_7"]
    visit(page, f"{url}/admin/event?source=flaky&id=evt_hostile", "event")
    text = page.inner_text("main")
    assert "<script>window.__pwned = 3</script>" in text
    assert "<script>window.__pwned = 4</script>" in text
    assert page.locator("pre.body").text_content() == HOSTILE.decode() + "\\xff"
    inert(page)

    # Outbox: filters by state and aggregate type; a parked row's detail.
    visit(page, f"{url}/admin/outbox", "outbox")
    page.select_option("select[name=state]", "parked")
    page.fill("input[name=aggregatetype]", "invoice")
    page.get_by_role("button", name="filter").click()
    page.wait_for_url("**state=parked*")
    states = page.locator("form table tr td:nth-child(6)").all_inner_texts()
    assert set(states) == {"parked"}
    assert len(states) == 10
    assert set(page.locator("form table tr td:nth-child(3)").all_inner_texts()) == {"invoice"}
    page.locator("form table tr td:nth-child(2) a").first.click()
    page.wait_for_url("**/admin/outbox/row?id=*")
    assert "broker refused: <b>no route</b>" in page.inner_text("main")
    if SHOTS:
        page.screenshot(path=str(Path(SHOTS) / "outbox-row.png"))
    row_id = int(page.url.rsplit("=", 1)[1])
    page.get_by_role("button", name="replay").click()
    page.wait_for_url("**/admin/outbox/replay")
    assert f"outbox row {row_id}" in page.inner_text("main")
    page.get_by_role("button", name="confirm replay").click()
    page.wait_for_url(f"**/admin/outbox/row?id={row_id}")
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT parked_at, attempts FROM pgonce.outbox WHERE id = %s", (row_id,)
        ).fetchone()
    assert row == (None, 0)

    visit(page, f"{url}/admin/health", "health")
    assert "oldest row vs retry horizon" in page.inner_text("main")

    # The overview's counts follow the database without a reload.
    visit(page, f"{url}/admin")
    assert page.locator("[data-live=inbox_dead]").inner_text() == "1"
    with psycopg.connect(dsn) as conn:
        conn.execute(
            "UPDATE pgonce.inbox SET status = 'dead' WHERE source = 'shop' AND event_id = 'hist_1'"
        )
    from playwright.sync_api import expect

    # Polled by Playwright from outside the page: the page's CSP forbids evaluating strings.
    expect(page.locator("[data-live=inbox_dead]")).to_have_text("2", timeout=15_000)
    assert errors == []


def test_a_bulk_replay_reaches_a_worker_and_the_events_are_done(
    dsn: str,
    service: Service,  # noqa: F811
    console: tuple[Page, list[str]],
) -> None:
    page, errors = console
    ids = ["evt_bulk_1", "evt_bulk_2", "evt_bulk_3"]
    for event_id in ids:
        deliver(service.url, "flaky", event_id)
    for event_id in ids:
        wait_until(partial(is_status, dsn, event_id, "dead"), "dead-lettered")
    with psycopg.connect(dsn) as conn:
        conn.execute(FIX)
    visit(page, f"{service.url}/admin/events?status=dead&source=flaky", "dead-letters")
    for event_id in ids[:2]:
        page.get_by_label(f"select {event_id}").check()
    page.get_by_role("button", name="replay selected").click()
    page.wait_for_url("**/admin/replay")
    assert "flaky / evt_bulk_1" in page.inner_text("main")
    if SHOTS:
        page.screenshot(path=str(Path(SHOTS) / "confirm.png"))
    page.get_by_role("button", name="confirm replay").click()
    page.wait_for_url("**replayed=2*")
    for event_id in ids[:2]:
        wait_until(partial(is_status, dsn, event_id, "done"), "replayed and done")
        assert effects(dsn, event_id) == 1
    assert status_of(dsn, "flaky", ids[2]) == "dead"
    # A form without the token, or from another site, changes nothing.
    forged = page.request.post(
        f"{service.url}/admin/replay",
        form={"all_of": "flaky", "confirm": "yes", "csrf": "forged"},
    )
    assert forged.status == 403
    cross = page.request.post(
        f"{service.url}/admin/replay",
        form={"all_of": "flaky", "confirm": "yes"},
        headers={"sec-fetch-site": "cross-site"},
    )
    assert cross.status == 403
    assert status_of(dsn, "flaky", ids[2]) == "dead"
    # A redelivery is a duplicate: an answer, not a row; the overview counts what was answered.
    deliver(service.url, "flaky", ids[0])
    visit(page, f"{service.url}/admin")
    answered = page.locator("tr", has_text="duplicate").locator("td").all_inner_texts()
    assert answered == ["flaky", "duplicate", "1"]
    stored = page.locator("tr", has_text="stored").locator("td").all_inner_texts()
    assert stored == ["flaky", "stored", "3"]
    assert errors == []


BAD_INPUT = [
    "/admin/keys?scope=%00&prefix=%00",
    "/admin/keys?scope=api&prefix=a%ffb&after=%00",
    "/admin/key?scope=%00&key=" + "k" * 5000,
    "/admin/events?status=nope&source=%00&after_at=not-a-time",
    "/admin/events?id=%00",
    "/admin/events?after_at=2026-13-45&after_source=x",
    "/admin/event?source=%00&id=%00",
    "/admin/outbox?state=%00&aggregatetype=%00&after=99999999999999999999999",
    "/admin/outbox/row?id=-1",
    "/admin/outbox/row?id=abc",
    "/admin/outbox/row?id=99999999999999999999999",
    "/admin/static/../admin.py",
    "/admin?window=%00",
]


def test_bad_input_gets_a_page_never_a_500(service: Service) -> None:  # noqa: F811
    import httpx

    auth = ("admin", TOKEN)
    for path in BAD_INPUT:
        answer = httpx.get(f"{service.url}{path}", auth=auth)
        assert answer.status_code in (200, 400, 404), (path, answer.status_code, answer.text)
        assert "Traceback" not in answer.text
    # Forms: a NUL, ids that are no ids, nothing selected; each refused with a page.
    csrf = AdminAuth(TOKEN).csrf
    for form in (
        {"csrf": csrf, "event": '["fl\u0000aky", "x"]', "confirm": "yes"},
        {"csrf": csrf, "all_of": "fl\x00aky", "confirm": "yes"},
        {"csrf": csrf, "event": "not json", "confirm": "yes"},
        {"csrf": csrf},
    ):
        answer = httpx.post(f"{service.url}/admin/replay", data=form, auth=auth)
        assert answer.status_code == 400, (form, answer.status_code, answer.text)
    for form in ({"csrf": csrf, "id": "abc", "confirm": "yes"}, {"csrf": csrf, "id": "-5"}):
        answer = httpx.post(f"{service.url}/admin/outbox/replay", data=form, auth=auth)
        assert answer.status_code == 400, (form, answer.status_code, answer.text)
