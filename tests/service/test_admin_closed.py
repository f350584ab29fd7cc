"""The admin surface through the real ``pgonce serve``: without a token nothing under /admin
answers anything but 404, whatever the method or path; with one, the guard answers before the
method is judged, so nobody without the token learns which admin URLs exist."""

from __future__ import annotations

from pathlib import Path

import httpx

from tests.service.test_serve import CONFIG, TOKEN, Service, service, start  # noqa: F401

PATHS = ["/admin", "/admin/", "/admin/replay", "/admin/outbox/replay", "/admin/static/console.js",
         "/admin/keys/", "/admin/no/such/page"]  # fmt: skip
METHODS = ["GET", "HEAD", "POST", "PUT", "DELETE", "OPTIONS"]


def test_without_a_token_every_admin_url_is_404(dsn: str, tmp_path: Path) -> None:
    closed = start(dsn, tmp_path, CONFIG.replace('[admin]\ntoken = "env:TEST_ADMIN_TOKEN"\n', ""))
    try:
        for path in PATHS:
            for method in METHODS:
                answer = httpx.request(method, closed.url + path, auth=("admin", TOKEN))
                assert answer.status_code == 404, (method, path, answer.status_code)
                assert "location" not in answer.headers
    finally:
        closed.stop()


def test_with_a_token_the_guard_answers_first(service: Service) -> None:  # noqa: F811
    for path in PATHS:
        for method in METHODS:
            answer = httpx.request(method, service.url + path)
            assert answer.status_code == 401, (method, path, answer.status_code)
    auth = ("admin", TOKEN)
    wrong = httpx.get(service.url + "/admin/replay", auth=auth)
    assert wrong.status_code == 405
    assert wrong.headers["allow"] == "POST"
    assert httpx.post(service.url + "/admin/keys", auth=auth).status_code == 405
    assert httpx.head(service.url + "/admin/keys", auth=auth).status_code == 200
    assert httpx.get(service.url + "/admin/", auth=auth).status_code == 404
