"""``pgonce doctor`` (and the other database commands) and ``pgonce send`` run where the
application's code is not installed: they run no handler, so the configuration's ``handler`` and
``[completer.operations]`` references are not imported (they were, and the command failed with
"cannot import 'shop'"). A reference that is not of the form ``module:function`` is still an error;
``pgonce serve``, which runs them, still imports them."""

from __future__ import annotations

from pathlib import Path

import pytest

from pgonce.cli import main
from pgonce.errors import ConfigError
from pgonce.service.config import load
from tests.loopback import close_unanswered, loopback

SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
CONFIG = """
[database]
dsn = "env:HANDLERS_ABSENT_DSN"
[sources.shop]
scheme = "standard-webhooks"
secrets = ["env:HANDLERS_ABSENT_SECRET"]
handler = "pgonce_absent_app.handlers:on_event"
[completer.operations]
pay = "pgonce_absent_app.payments:pay"
"""


@pytest.fixture
def config(tmp_path: Path, direct_dsn: str, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("HANDLERS_ABSENT_DSN", direct_dsn)
    monkeypatch.setenv("HANDLERS_ABSENT_SECRET", SECRET)
    path = tmp_path / "pgonce.toml"
    path.write_text(CONFIG)
    return path


def test_doctor_needs_no_handler_module(config: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["doctor", "--config", str(config)])
    out, err = capsys.readouterr()
    assert "cannot import" not in err
    assert code == 0, (out, err)


def test_send_needs_no_handler_module(config: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with loopback(close_unanswered) as address:
        code = main(
            ["send", "--config", str(config), "--source", "shop", "--url", f"http://{address}"]
        )
    err = capsys.readouterr().err
    # It signed and sent: the configuration was read, the server is what failed.
    assert "cannot import" not in err
    assert f"http://{address}/webhooks/shop gave no complete answer" in err
    assert code == 1


def test_a_reference_of_the_wrong_form_is_still_an_error(
    config: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config.write_text(CONFIG.replace("pgonce_absent_app.handlers:on_event", "on_event"))
    assert main(["doctor", "--config", str(config)]) == 1
    assert "sources.shop.handler: 'on_event' is not of the form module:function" in (
        capsys.readouterr().err
    )


def test_serve_still_imports_them(config: Path) -> None:
    with pytest.raises(ConfigError, match=r"cannot import 'pgonce_absent_app\.handlers'"):
        load(config)
