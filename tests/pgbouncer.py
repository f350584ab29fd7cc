"""A PgBouncer of the suite's own, in transaction pooling mode, in front of the test server.

Debian's pgbouncer (1.18 on this project's CI) is started once per test process on a free port,
with ``auth_type = trust`` and a wildcard database entry, so that every per-test database of the
test server is reachable through it under the same name. It runs as an unprivileged user when the
suite runs as root (PgBouncer refuses root). Without the binary the tests that need it skip with
the reason, except under ``PGONCE_REQUIRE_SERVICES=1`` (CI), where they fail.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo


def _free_port() -> int:
    with contextlib.closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def require_pgbouncer() -> str:
    """The pgbouncer binary; skip (fail under PGONCE_REQUIRE_SERVICES=1) when it is missing."""
    binary = shutil.which("pgbouncer") or next(
        (p for p in ("/usr/sbin/pgbouncer", "/usr/bin/pgbouncer") if os.access(p, os.X_OK)), None
    )
    if binary:
        return binary
    reason = "pgbouncer is not installed (apt-get install pgbouncer) to run the pooled variants"
    if os.environ.get("PGONCE_REQUIRE_SERVICES") == "1":
        pytest.fail(f"{reason} (PGONCE_REQUIRE_SERVICES=1 requires it)")
    pytest.skip(reason)


@contextlib.contextmanager
def running_pgbouncer(server_dsn: str, *, pool_size: int = 10) -> Iterator[str]:
    """Start PgBouncer in front of ``server_dsn``; yield the server DSN rewritten to go through
    it (same user and database). Stopped, and its folder removed, on exit.

    ``pool_size`` server sessions per database: the test server's 100 connections are shared by
    parallel test processes. A server login refused meanwhile (too many clients) is tried again
    after a second, not after PgBouncer's default 15 s, during which its clients' logins wait.
    """
    binary = require_pgbouncer()
    server = conninfo_to_dict(server_dsn)
    host = str(server.get("host") or "127.0.0.1")
    port = str(server.get("port") or 5432)
    user = str(server.get("user") or "postgres")
    listen_port = _free_port()
    folder = Path(tempfile.mkdtemp(prefix="pgonce-pgbouncer-"))
    (folder / "users.txt").write_text(f'"{user}" ""\n')
    config = folder / "pgbouncer.ini"
    config.write_text(
        f"""[databases]
* = host={host} port={port}

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {listen_port}
unix_socket_dir =
auth_type = trust
auth_file = {folder}/users.txt
pool_mode = transaction
max_client_conn = 1000
default_pool_size = {pool_size}
server_login_retry = 1
ignore_startup_parameters = extra_float_digits,options
logfile = {folder}/pgbouncer.log
pidfile = {folder}/pgbouncer.pid
"""
    )
    command = [binary, str(config)]
    if os.geteuid() == 0:
        # The embedded server's socket folder is its own user's alone: run as that user there.
        if host.startswith("/"):
            entry = pwd.getpwuid(os.stat(host).st_uid)
        else:
            entry = pwd.getpwnam("postgres" if _has_user("postgres") else "nobody")
        account = entry.pw_name
        for path in (folder, *folder.iterdir()):
            os.chown(path, entry.pw_uid, entry.pw_gid)
        command[1:1] = ["-u", account]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        _wait_for_port(listen_port, process, folder)
        yield make_conninfo(server_dsn, host="127.0.0.1", port=str(listen_port))
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        shutil.rmtree(folder, ignore_errors=True)


def _has_user(name: str) -> bool:
    try:
        pwd.getpwnam(name)
    except KeyError:
        return False
    return True


def _wait_for_port(port: int, process: subprocess.Popen[bytes], folder: Path) -> None:
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        if process.poll() is not None:
            output = process.stdout.read().decode() if process.stdout else ""
            log = folder / "pgbouncer.log"
            raise RuntimeError(
                f"pgbouncer exited with {process.returncode}: {output}"
                f"{log.read_text() if log.exists() else ''}"
            )
        with contextlib.closing(socket.socket()) as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError(f"pgbouncer did not listen on port {port} within 15 s")
