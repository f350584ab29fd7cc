"""The command line writing into a pipe whose reader is gone (``pgonce doctor | head -1``)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.test_cli import ROOT


def closed_pipe_run(*args: str, dsn: str) -> subprocess.CompletedProcess[str]:
    """Run the command line with its stdout a pipe already closed at the reading end."""
    read, write = os.pipe()
    os.close(read)
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PGONCE_")}
        return subprocess.run(
            [sys.executable, "-m", "pgonce", "--dsn", dsn, *args],
            cwd=ROOT,
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
            env=env,
            check=False,
        )
    finally:
        os.close(write)


@pytest.mark.parametrize("args", [("doctor",), ("events",), ("sweep", "--dry-run"), ("migrate",)])
def test_a_reader_that_went_away_is_no_internal_error(args: tuple[str, ...], dsn: str) -> None:
    result = closed_pipe_run(*args, dsn=dsn)
    assert "internal error" not in result.stderr, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    assert "BrokenPipe" not in result.stderr, result.stderr
    assert "Exception ignored" not in result.stderr, result.stderr
    # Nothing was lost that anyone was reading, but the output is not all out: not a success.
    assert result.returncode == 1, result.stderr
