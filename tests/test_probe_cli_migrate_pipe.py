"""``pgonce migrate`` whose output has no reader (``pgonce migrate | head -1``): the lines stop,
the migrations do not. Before, the first line that could not be written ended the run after one
or two migrations, with exit 1 and nothing said."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psycopg

from pgonce import sql as pgsql
from pgonce.store.migrate import status

ROOT = Path(__file__).resolve().parent.parent


def test_a_reader_that_went_away_does_not_stop_the_migrations(direct_dsn: str) -> None:
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the first line
    try:
        run = subprocess.run(
            [sys.executable, "-m", "pgonce", "migrate", "--dsn", direct_dsn, "--schema", "piped"],
            cwd=ROOT,
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
            check=False,
        )
    finally:
        os.close(write_end)
    assert run.returncode == 1, run.stderr  # output was lost, as every command reports it
    assert "Traceback" not in run.stderr
    assert "internal error" not in run.stderr
    with psycopg.connect(direct_dsn, autocommit=True) as conn:
        state = status(conn, "piped")
    assert state.up_to_date, state
    assert state.current == pgsql.migrations()[-1].version
