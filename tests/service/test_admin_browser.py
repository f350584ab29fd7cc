"""The admin page in a real browser: headless Chromium (Debian's package) driven by Playwright.

Against the real ``pgonce serve`` process: a delivery whose handler fails is dead-lettered at once
(``attempts = 1``); in the browser the overview shows the dead letter, the events page filtered by
status lists it (and not the event of the healthy source), its detail page shows the handler's
error; once the handler is fixed, the replay button puts it back, and the database shows the event
done with its one effect. Without the token, the page answers 401.

Playwright never downloads a browser here: it drives ``/usr/bin/chromium``. Without it the test
skips with the reason, except under ``PGONCE_REQUIRE_SERVICES=1`` (CI), where it fails.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import psycopg
import pytest

from pgonce.service.demo import SETUP as DEMO_SETUP
from tests.service.handlers import BROKEN, FIX
from tests.service.handlers import SETUP as HANDLER_SETUP
from tests.service.test_serve import CONFIG as SHOP_CONFIG
from tests.service.test_serve import SCHEME, TOKEN, Service, start

if TYPE_CHECKING:
    from playwright.sync_api import Browser

CHROMIUM = Path("/usr/bin/chromium")
#: Quiet, self-contained Chromium: no sandbox (tests run as root), no GPU, no calls home.
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
#: The end-to-end tests' service (``shop``: the demo handler), plus ``flaky``: a handler that
#: fails until fixed, with one attempt, so its events are dead-lettered at once.
CONFIG = (
    SHOP_CONFIG
    + """
[sources.flaky]
scheme = "standard-webhooks"
secrets = ["env:TEST_SHOP_SECRET"]
handler = "tests.service.handlers:fail_until_fixed"
attempts = 1
"""
)
SCREENSHOTS = Path(tempfile.gettempdir())


def require_chromium() -> None:
    """Skip (fail under PGONCE_REQUIRE_SERVICES=1) unless Playwright and Chromium are there."""
    reason = None
    if not CHROMIUM.exists():
        reason = f"{CHROMIUM} is missing: apt-get install chromium"
    else:
        try:
            import playwright.sync_api  # noqa: F401
        except ImportError:
            reason = "playwright is not installed: make sync"
    if reason is None:
        return
    if os.environ.get("PGONCE_REQUIRE_SERVICES") == "1":
        pytest.fail(f"{reason} (PGONCE_REQUIRE_SERVICES=1 requires it)")
    pytest.skip(reason)


@pytest.fixture
def browser() -> Iterator[Browser]:
    require_chromium()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        launched = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            yield launched
        finally:
            launched.close()


@pytest.fixture
def service(dsn: str, tmp_path: Path) -> Iterator[Service]:
    with psycopg.connect(dsn) as conn:
        conn.execute(DEMO_SETUP)
        conn.execute(HANDLER_SETUP)
    running = start(dsn, tmp_path, CONFIG)
    try:
        yield running
    finally:
        if running.process.poll() is None:
            running.stop()


def deliver(url: str, source: str, event_id: str) -> None:
    body = json.dumps(
        {"type": "order.created", "data": {"run": "admin", "order": event_id, "amount": 1}}
    ).encode()
    headers = {**SCHEME.sign(body, event_id=event_id), "content-type": "application/json"}
    response = httpx.post(f"{url}/webhooks/{source}", content=body, headers=headers)
    assert response.status_code == 200, response.text


def status_of(dsn: str, source: str, event_id: str) -> str | None:
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT status FROM pgonce.inbox WHERE source = %s AND event_id = %s",
            (source, event_id),
        ).fetchone()
    return None if row is None else str(row[0])


def effects(dsn: str, event_id: str) -> int:
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT count(*) FROM service_test.effects WHERE event_id = %s", (event_id,)
        ).fetchone()
    assert row is not None
    return int(row[0])


def wait_until(check: Callable[[], bool], what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.05)


def test_replay_a_dead_letter_from_the_admin_page(
    dsn: str, service: Service, browser: Browser
) -> None:
    dead_id, healthy_id = "evt_flaky_1", "evt_shop_1"
    deliver(service.url, "flaky", dead_id)
    deliver(service.url, "shop", healthy_id)
    wait_until(lambda: status_of(dsn, "flaky", dead_id) == "dead", "the event is dead-lettered")
    wait_until(lambda: status_of(dsn, "shop", healthy_id) == "done", "the shop event is handled")
    assert effects(dsn, dead_id) == 0

    context = browser.new_context(
        http_credentials={"username": "admin", "password": TOKEN},
        viewport={"width": 1280, "height": 800},
    )
    page = context.new_page()

    # Overview: one dead letter for the flaky source, linked to the filtered events page.
    response = page.goto(f"{service.url}/admin")
    assert response is not None
    assert response.status == 200
    dead_row = page.locator("tr", has=page.locator("a.dead"))
    assert dead_row.count() == 1
    cells = dead_row.locator("td").all_inner_texts()
    assert cells[:3] == ["flaky", "dead", "1"]
    page.screenshot(path=str(SCREENSHOTS / "pgonce-admin-overview.png"), full_page=True)

    # Events: both events unfiltered; filtered by status=dead through the form, only the dead one.
    page.goto(f"{service.url}/admin/events")
    assert page.get_by_role("link", name=healthy_id).count() == 1
    page.select_option("select[name=status]", "dead")
    page.get_by_role("button", name="filter").click()
    page.wait_for_url("**/admin/events?*status=dead*")
    assert page.get_by_role("link", name=dead_id).count() == 1
    assert page.get_by_role("link", name=healthy_id).count() == 0
    assert BROKEN in page.inner_text("table")
    page.screenshot(path=str(SCREENSHOTS / "pgonce-admin-dead.png"), full_page=True)

    # Detail: the error, the signed headers and the body of the dead letter.
    page.get_by_role("link", name=dead_id).click()
    page.wait_for_url("**/admin/event?*")
    assert page.inner_text("h1") == f"Event {dead_id}"
    text = page.inner_text("main")
    assert BROKEN in text
    assert f"webhook-id: {dead_id}" in text
    assert '"order": "evt_flaky_1"' in text
    page.screenshot(path=str(SCREENSHOTS / "pgonce-admin-event.png"), full_page=True)

    # Fix the handler, replay from the page: the event is handled, once.
    with psycopg.connect(dsn) as conn:
        conn.execute(FIX)
    page.get_by_role("button", name="replay").click()
    page.wait_for_url("**/admin/replay")
    assert f"flaky / {dead_id}" in page.inner_text("main")
    page.get_by_role("button", name="confirm replay").click()
    page.wait_for_url("**/admin/event?*")
    wait_until(lambda: status_of(dsn, "flaky", dead_id) == "done", "the replayed event is done")
    assert effects(dsn, dead_id) == 1
    page.reload()
    assert "done" in page.locator("tr", has_text="status").first.inner_text()
    assert page.get_by_role("button", name="replay").count() == 0
    context.close()


def test_admin_page_refuses_a_browser_without_the_token(service: Service, browser: Browser) -> None:
    from playwright.sync_api import Error, Response

    # No credentials: the server challenges (401, Basic), and headless Chromium, having nothing
    # to answer with, gives the navigation up: the page never opens.
    anonymous = browser.new_context()
    page = anonymous.new_page()
    answers: list[Response] = []
    page.on("response", lambda response: answers.append(response))
    with pytest.raises(Error, match="ERR_INVALID_AUTH_CREDENTIALS"):
        page.goto(f"{service.url}/admin")
    assert [r.status for r in answers] == [401]
    assert answers[0].headers["www-authenticate"].startswith("Basic ")
    denied = anonymous.request.get(f"{service.url}/admin/events")
    assert denied.status == 401
    assert "evt_" not in denied.text()
    anonymous.close()
    # A wrong token: Chromium answers the challenge, and the page it shows is the 401.
    wrong = browser.new_context(http_credentials={"username": "admin", "password": "wrong"})
    shown = wrong.new_page().goto(f"{service.url}/admin")
    assert shown is not None
    assert shown.status == 401
    assert "admin token" in shown.text()
    wrong.close()
