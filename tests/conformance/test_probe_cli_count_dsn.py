"""A --dsn for --count-sql that libpq cannot parse is refused without its text: libpq's error
quotes the connection string, and the kit printed it ('missing "=" after "<the password>"' for a
password pasted alone, the end of a password with an unescaped @ as the host it could not find).
"""

from __future__ import annotations

import pytest

from pgonce.cli import main

SECRET = "pw5ecretXYZ"


@pytest.mark.parametrize(
    "dsn",
    [
        SECRET,
        f"postgresql://u:pw@{SECRET}@127.0.0.1:5432/db",
    ],
)
def test_an_unparsable_count_dsn_is_refused_without_its_text(
    dsn: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # The endpoint is never reached: the count's connection is opened first.
    code = main(
        ["conformance", "http", "http://127.0.0.1:1/pay", "--count-sql", "SELECT 1", "--dsn", dsn]
    )
    captured = capsys.readouterr()
    assert code == 1, captured.err
    assert SECRET not in captured.err + captured.out
    assert captured.err.startswith("pgonce: error: cannot connect to --dsn for --count-sql: "), (
        captured.err
    )
    assert "Traceback" not in captured.err
