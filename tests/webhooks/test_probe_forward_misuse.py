"""``forward_to`` given a URL that cannot be forwarded to (no scheme, not HTTP, no host, not a
string) or an extra header httpx cannot send (beyond ASCII, not text) is refused when the handler
is made, with a :class:`~pgonce.errors.ConfigError` that names the mistake and not the URL's
credentials. It was taken, and every event of the source then failed at each retry (an
``UnsupportedProtocol``, a ``UnicodeEncodeError``), until it was dead-lettered, never forwarded."""

from __future__ import annotations

from typing import Any

import pytest

from pgonce.errors import ConfigError
from pgonce.webhooks.forward import forward_to


@pytest.mark.parametrize(
    "url",
    ["localhost:8000/hooks", "ftp://svc:s3cr3t@example.com/hooks", "http://", "", 8000, None],
    ids=["no-scheme", "ftp", "no-host", "empty", "int", "none"],
)
def test_a_url_that_cannot_be_forwarded_to_is_refused_at_once(url: Any) -> None:
    with pytest.raises(ConfigError, match="forward") as refused:
        forward_to(url)
    assert "s3cr3t" not in str(refused.value)


@pytest.mark.parametrize(
    "headers",
    [[("x-team", "\u00e9quipe")], [("x-team", 1)], [("x-t\u00e9am", "a")], [("x-team",)], "x-team"],
    ids=["value-beyond-ascii", "value-not-text", "name-beyond-ascii", "not-a-pair", "a-str"],
)
def test_an_extra_header_httpx_cannot_send_is_refused_at_once(headers: Any) -> None:
    with pytest.raises(ConfigError, match="header"):
        forward_to("http://127.0.0.1:8000/hooks", headers=headers)


def test_a_good_url_and_headers_are_taken() -> None:
    assert callable(forward_to("https://svc.internal:8443/hooks", headers=[("x-team", "a")]))


def test_a_configured_forward_without_a_host_is_a_problem_of_its_key(tmp_path: Any) -> None:
    from pgonce.service.config import load

    path = tmp_path / "pgonce.toml"
    path.write_text(
        "[sources.fwd]\nscheme = 'standard-webhooks'\nsecrets = ['env:S']\nforward = 'http://'\n"
    )
    env = {"S": "whsec_C2FVsBQIhrscChlQIMV+b5sSYspob7oD"}
    with pytest.raises(ConfigError, match=r"sources\.fwd\.forward: .*with a host"):
        load(path, env)
