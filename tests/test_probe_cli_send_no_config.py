"""``pgonce send`` without a configuration file says that none was given, not only that the
"environment" has no such source."""

from __future__ import annotations

import pytest

from pgonce.cli import main


def test_send_without_a_configuration_names_the_missing_file(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PGONCE_CONFIG", raising=False)
    code = main(["send", "--source", "shop", "--url", "http://127.0.0.1:1"])
    err = capsys.readouterr().err
    assert code == 1
    assert err == (
        "pgonce: error: no source 'shop': no configuration file was given (--config or "
        "$PGONCE_CONFIG) and the environment configures no source\n"
    )
