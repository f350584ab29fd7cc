"""A real uvicorn server in its own process, on a loopback socket bound by the caller.

``serve("pkg.module:factory", env, log)`` binds 127.0.0.1 on a free port, hands the listening
socket to a child process (``python -m bench.servers FD pkg.module:factory``), waits until it
accepts connections, yields the port, and stops the server (SIGTERM, then SIGKILL) on exit.
Binding in the parent leaves no race for the port.

The child wraps the inherited descriptor with ``socket.socket(fileno=...)``, which detects its
real family. ``uvicorn --fd`` would take it for a Unix socket, and asyncio then leaves TCP_NODELAY
off on accepted connections: every response would wait 40 ms for the client's delayed ACK.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path

import psycopg

ROOT = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def serve(factory: str, env: Mapping[str, str], log: Path, *, ready: float = 30) -> Iterator[int]:
    """Run ``factory`` (an ASGI app factory) under uvicorn; yield the port it listens on."""
    with serve_process(factory, env, log, ready=ready) as (port, _):
        yield port


@contextlib.contextmanager
def serve_process(
    factory: str,
    env: Mapping[str, str],
    log: Path,
    *,
    ready: float = 30,
    wrapper: Sequence[str] = (),
    stop: float = 10,
) -> Iterator[tuple[int, int]]:
    """:func:`serve`, yielding the server's process id too (to read its CPU time).

    ``wrapper`` prefixes the server's command (a profiler, e.g. valgrind); ``stop`` is how long
    the server may take to exit after SIGTERM before it is killed.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(1024)
    port = int(sock.getsockname()[1])
    command = [*wrapper, sys.executable, "-m", "bench.servers", str(sock.fileno()), factory]
    with log.open("ab") as out:
        process = subprocess.Popen(
            command,
            cwd=ROOT,
            env={**os.environ, **env},
            pass_fds=[sock.fileno()],
            stdout=out,
            stderr=out,
        )
    sock.close()
    try:
        deadline = time.monotonic() + ready
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"the server for {factory} exited; see {log}")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server for {factory} never listened; see {log}")
            time.sleep(0.05)
        yield port, process.pid
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=stop)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def process_cpu(pid: int) -> float:
    """CPU seconds the live process ``pid`` has spent, all its threads, those that ended
    included (0 once it exited): ``/proc/<pid>/stat``, in clock ticks (10 ms)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0  # exited meanwhile
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def backend_cpu(pid: int) -> float:
    """CPU seconds a PostgreSQL process (one thread: a backend, the WAL writer...) has spent.

    From ``/proc/<pid>/schedstat``, in nanoseconds, where the kernel keeps it: stat's clock
    ticks (10 ms) are a large share of what a backend spends in a round of a few seconds, and a
    sum over eight backends carries eight such errors. schedstat counts the process's first
    thread only, which for PostgreSQL's processes is all of them.
    """
    try:
        with open(f"/proc/{pid}/schedstat") as schedstat:
            return int(schedstat.read().split()[0]) / 1e9
    except (OSError, ValueError, IndexError):
        return process_cpu(pid)  # no schedstat in this kernel, or exited: stat says which


def cpu_seconds(pids: Iterable[int]) -> float:
    """User + system CPU time of the live processes among ``pids`` (Linux ``/proc``)."""
    return sum(process_cpu(pid) for pid in pids)


def database_pids(dsn: str) -> list[int]:
    """This database's backends and PostgreSQL's background processes (not other databases'
    clients: the server may be shared)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE pid <> pg_backend_pid()"
            " AND (datname = current_database() OR backend_type <> 'client backend')"
        )
        return [int(pid) for (pid,) in rows.fetchall()]


def database_cpu(pids: Iterable[int]) -> dict[int, float]:
    """Each process's CPU seconds so far: the reading before a round, for
    :func:`database_cpu_spent`."""
    return {pid: backend_cpu(pid) for pid in pids}


def database_cpu_spent(before: dict[int, float]) -> float:
    """CPU seconds spent since ``before`` by the processes alive at both readings: one that
    exited meanwhile (the previous variant's backend, closing) would otherwise count its whole
    life negative."""
    spent = 0.0
    for pid, seconds in before.items():
        if os.path.exists(f"/proc/{pid}"):
            spent += backend_cpu(pid) - seconds
    return spent


def main() -> None:
    """``python -m bench.servers FD module:factory``: uvicorn on an inherited listening socket."""
    import uvicorn

    sock = socket.socket(fileno=int(sys.argv[1]))
    config = uvicorn.Config(sys.argv[2], factory=True, log_level="warning", access_log=False)
    uvicorn.Server(config).run(sockets=[sock])


if __name__ == "__main__":
    main()
