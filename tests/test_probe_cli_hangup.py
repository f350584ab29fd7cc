"""A hang-up (SIGHUP: the terminal or the SSH session that ran the command closed) while a command
starts the embedded PostgreSQL: it stops the command as SIGTERM does, closing what it opened.
Its default ended the process on the spot, and the server the command had started ran on alone."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

from tests.test_probe_embedded_first_start import (
    data_dir,
    environment,
    status,
    wait_for_initdb,
    wait_until_gone,
)

__all__ = ["data_dir"]  # the fixture


def first_start(data_dir: Path, hangup: signal.Handlers = signal.SIG_DFL) -> subprocess.Popen[str]:
    """``pgonce migrate`` on an empty data folder, SIGHUP's disposition set to ``hangup``."""
    return subprocess.Popen(
        [sys.executable, "-m", "pgonce", "migrate", "--data-dir", str(data_dir)],
        cwd=data_dir.parent,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=environment(),
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGHUP, hangup),
    )


def test_sighup_while_the_embedded_server_starts_stops_it_too(data_dir: Path) -> None:
    process = first_start(data_dir)
    try:
        wait_for_initdb(data_dir, process)
        process.send_signal(signal.SIGHUP)
        _, err = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 128 + signal.SIGTERM, err
    assert "Traceback" not in err
    assert err.splitlines()[-1] == "pgonce: terminated", err
    wait_until_gone(data_dir, but=process.pid)
    again = status(data_dir)
    assert again.stdout.startswith("schema pgonce: version 0 of "), again.stderr


def test_a_command_run_under_nohup_keeps_running_on_sighup(data_dir: Path) -> None:
    # nohup (or a parent) set SIGHUP to be ignored: the hang-up must not stop the command.
    process = first_start(data_dir, hangup=signal.SIG_IGN)
    try:
        wait_for_initdb(data_dir, process)
        process.send_signal(signal.SIGHUP)
        _, err = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 0, err
    assert "Traceback" not in err
    wait_until_gone(data_dir, but=process.pid)
    again = status(data_dir)
    first, latest = again.stdout.split()[3::2]  # "schema pgonce: version N of M": migrated
    assert first == latest, again.stdout
