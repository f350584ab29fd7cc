"""Production topologies the suite builds for itself: a PgBouncer in transaction pooling mode, and a
pg_auto_failover formation (a monitor and two PostgreSQL nodes with synchronous replication).

Both are started from the machine's Debian packages (``pgbouncer``; ``postgresql-<major>-auto-
failover``), on free loopback ports, in a temporary folder of the suite's; both are stopped, and
their folders deleted, on exit, whatever happened. Only processes started here are signalled, each
by its own pid (and, for a node that is killed, the processes that pid started).

PgBouncer and pg_autoctl refuse to run as root: when the suite runs as root, PgBouncer runs as the
embedded server's own user (which owns the socket it connects to) and pg_autoctl as ``postgres``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

import psycopg

from faults.proxy import free_port
from pgonce.config import DEFAULT_SCHEMA
from pgonce.service.demo import SETUP
from pgonce.store.migrate import migrate

#: How long a formation may take to reach a state (initdb, base backup, promotion) on a busy
#: 2-core machine before the suite gives up.
STATE_TIMEOUT = 180.0
#: How often a state is read again while waiting for it.
POLL = 0.05
#: Where :meth:`Formation.writable` writes: a table of the suite's, in the formation's database.
WRITABLE_TABLE = (
    "CREATE TABLE IF NOT EXISTS faults_writable (at timestamptz NOT NULL DEFAULT now())"
)
WRITABLE_INSERT = "INSERT INTO faults_writable DEFAULT VALUES"


class Unavailable(RuntimeError):
    """A package the scenario needs is not installed; the message names it."""


def _runs_as(name: str) -> tuple[str | None, int | None]:
    """The user (and its group) a server must run as: ``name`` when the suite is root."""
    if os.geteuid() != 0:
        return None, None
    return name, pwd.getpwnam(name).pw_gid


def _hand_over(folder: Path, user: str | None) -> None:
    if user is not None:
        shutil.chown(folder, user)


def _descendants(pid: int) -> list[int]:
    """``pid``'s children, grandchildren, ... as /proc shows them now."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            # The command name may hold spaces and parentheses: the fields follow the last ')'.
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    found: list[int] = []
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _kill_tree(process: subprocess.Popen[bytes]) -> None:
    """SIGKILL ``process`` and every process it started, all at once (a machine that died)."""
    pids = [process.pid, *_descendants(process.pid)]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    process.wait(timeout=30)


# ## PgBouncer


class PgBouncer:
    """A PgBouncer of the suite's own in transaction pooling mode, in front of one server.

    The one launcher of the project: the fault scenarios, the test suite's pooled variants
    (``tests/pgbouncer.py``) and the benchmarks start PgBouncer through it. Its output goes to a
    file: a pipe nobody reads fills after a few hundred log lines, and PgBouncer, blocked on that
    write, then stops answering logins.
    """

    def __init__(
        self,
        folder: Path,
        *,
        host: str,
        port: int,
        pool_size: int = 20,
        pool_mode: str = "transaction",
    ) -> None:
        self.binary = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"
        if not Path(self.binary).exists():
            raise Unavailable("PgBouncer is not installed (Debian: apt-get install -y pgbouncer)")
        self.folder = folder
        self.port = free_port()
        self.log = folder / "pgbouncer.log"
        self.user, self.group = _runs_as(_owner(host))
        folder.mkdir(parents=True, exist_ok=True)
        _hand_over(folder, self.user)
        self.config = folder / "pgbouncer.ini"
        # auth_type any: the loopback test server trusts its clients; PgBouncer logs in as the
        # server's superuser whatever the client names. Transaction pooling: a server connection
        # is another client's after every COMMIT, which is what pgonce must survive. A server
        # login refused meanwhile (too many clients) is tried again after a second, not after
        # PgBouncer's default 15 s, during which its clients' logins wait.
        self.config.write_text(
            "[databases]\n"
            f"* = host={host} port={port} user=postgres\n"
            "[pgbouncer]\n"
            "listen_addr = 127.0.0.1\n"
            f"listen_port = {self.port}\n"
            "unix_socket_dir =\n"
            "auth_type = any\n"
            f"pool_mode = {pool_mode}\n"
            f"default_pool_size = {pool_size}\n"
            "max_client_conn = 1000\n"
            "server_login_retry = 1\n"
            "ignore_startup_parameters = extra_float_digits,options\n"
            f"logfile = {folder / 'pgbouncer.server.log'}\n"
        )
        self.process: subprocess.Popen[bytes] | None = None

    def version(self) -> str:
        out = subprocess.run(
            [self.binary, "--version"], capture_output=True, text=True, timeout=10, check=False
        )
        return out.stdout.splitlines()[0].strip() if out.stdout else "PgBouncer"

    def start(self) -> None:
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(
                [self.binary, str(self.config)],
                stdout=out,
                stderr=subprocess.STDOUT,
                user=self.user,
                group=self.group,
                extra_groups=[] if self.user else None,
            )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"pgbouncer exited with {self.process.returncode}: {self.tail()}"
                )
            with (
                contextlib.suppress(psycopg.Error),
                # autocommit: no BEGIN, which a PgBouncer in statement mode refuses
                psycopg.connect(self.dsn("postgres"), connect_timeout=2, autocommit=True) as conn,
            ):
                conn.execute("SELECT 1")
                return
            time.sleep(POLL)
        raise RuntimeError(f"pgbouncer did not accept connections on port {self.port}")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            # SIGINT: PgBouncer's "safe shutdown" waits for clients; SIGTERM closes at once.
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=30)

    def dsn(self, database: str) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}?connect_timeout=5"

    def tail(self, lines: int = 30) -> str:
        """The last lines PgBouncer wrote, for a failure's message."""
        text = []
        for path in (self.log, self.folder / "pgbouncer.server.log"):
            with contextlib.suppress(OSError):
                text.extend(path.read_text(errors="replace").splitlines()[-lines:])
        return "\n".join(text)


def _owner(host: str) -> str:
    """Who may connect to ``host``: the owner of a server's socket folder; for an address, the
    ``postgres`` account when there is one."""
    if host.startswith("/"):
        return pwd.getpwuid(os.stat(host).st_uid).pw_name
    try:
        return pwd.getpwnam("postgres").pw_name
    except KeyError:
        return "nobody"


class _Server(Protocol):
    def start(self) -> None: ...
    def stop(self) -> None: ...


S = TypeVar("S", bound=_Server)


@contextlib.contextmanager
def _started(prefix: str, build: Callable[[Path], S]) -> Iterator[S]:
    """``build(folder)`` in a new temporary folder, started; stopped and the folder deleted on
    exit, whatever happened (a start that failed half-way is stopped too)."""
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    server: S | None = None
    try:
        server = build(folder)
        server.start()
        yield server
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(folder, ignore_errors=True)


def pgbouncer(
    *, host: str, port: int, pool_size: int = 20, pool_mode: str = "transaction"
) -> contextlib.AbstractContextManager[PgBouncer]:
    """A started :class:`PgBouncer` in front of ``host:port`` (a socket folder or an address)."""
    return _started(
        "pgonce-pgbouncer-",
        lambda f: PgBouncer(f, host=host, port=port, pool_size=pool_size, pool_mode=pool_mode),
    )


# ## pg_auto_failover


def _auto_failover_bindir() -> Path:
    """The PostgreSQL whose pg_auto_failover extension is installed (its bin folder)."""
    for control in sorted(Path("/usr/share/postgresql").glob("*/extension/pgautofailover.control")):
        bindir = Path("/usr/lib/postgresql") / control.parts[-3] / "bin"
        if (bindir / "pg_ctl").exists():
            return bindir
    raise Unavailable(
        "pg_auto_failover is not installed for the machine's PostgreSQL (Debian: apt-get install "
        "-y postgresql-<major>-auto-failover, e.g. postgresql-15-auto-failover)"
    )


@dataclass(frozen=True)
class Node:
    name: str
    port: int
    state: str
    goal: str


class Formation:
    """A pg_auto_failover monitor and two nodes (``node1``, ``node2``) on loopback ports.

    Synchronous replication (pg_auto_failover's default for two nodes: ``synchronous_standby_names
    = 'ANY 1 (...)'``), trust authentication, no TLS, a database ``database`` on the formation.
    """

    NODES = ("node1", "node2")

    def __init__(self, folder: Path, database: str) -> None:
        self.pg_autoctl = shutil.which("pg_autoctl") or "/usr/bin/pg_autoctl"
        self.bindir = _auto_failover_bindir()
        if not Path(self.pg_autoctl).exists():
            raise Unavailable("pg_autoctl is not installed (Debian: pg-auto-failover-cli)")
        self.folder = folder
        self.database = database
        self.user, self.group = _runs_as("postgres")
        folder.mkdir(parents=True, exist_ok=True)
        _hand_over(folder, self.user)
        self.monitor_port = free_port()
        self.ports = {name: free_port() for name in self.NODES}
        #: The pg_autoctl process of each role, as started last (its tree is the node).
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self.logs: list[Path] = []
        self.env = {
            **os.environ,
            # pg_autoctl keeps its configuration and state under these: the suite's folder.
            "XDG_CONFIG_HOME": str(folder / "config"),
            "XDG_DATA_HOME": str(folder / "data"),
            "XDG_RUNTIME_DIR": str(folder / "run"),
            "PG_CONFIG": str(self.bindir / "pg_config"),
        }
        self.env.pop("PGDATA", None)
        #: Nodes killed and not restarted yet: their pg_autoctl is expected to be gone.
        self.killed: set[str] = set()
        self._monitor: psycopg.Connection[Any] | None = None

    @property
    def monitor_uri(self) -> str:
        return f"postgres://autoctl_node@127.0.0.1:{self.monitor_port}/pg_auto_failover?sslmode=disable"

    def dsn(self, **extra: str) -> str:
        """The multi-host DSN an application uses: libpq tries both nodes and keeps the one that
        accepts writes."""
        ports = ",".join(str(self.ports[n]) for n in self.NODES)
        options = {"connect_timeout": "2", **extra}
        return (
            f"host=127.0.0.1,127.0.0.1 port={ports} dbname={self.database} user=postgres "
            "target_session_attrs=read-write " + " ".join(f"{k}={v}" for k, v in options.items())
        )

    def node_dsn(self, name: str) -> str:
        return (
            f"host=127.0.0.1 port={self.ports[name]} dbname={self.database} user=postgres "
            "connect_timeout=1"
        )

    def _spawn(self, role: str, argv: list[str]) -> subprocess.Popen[bytes]:
        log = self.folder / f"{role}.log"
        self.logs.append(log)
        with log.open("ab") as out:
            process = subprocess.Popen(
                [self.pg_autoctl, *argv],
                cwd=self.folder,
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                user=self.user,
                group=self.group,
                extra_groups=[] if self.user else None,
            )
        self.processes[role] = process
        return process

    def _common(self, role: str, port: int) -> list[str]:
        return [
            "--pgdata", str(self.folder / role), "--pgport", str(port),
            "--hostname", "127.0.0.1", "--auth", "trust", "--no-ssl",
            "--pgctl", str(self.bindir / "pg_ctl"),
        ]  # fmt: skip

    def start(self) -> None:
        """Monitor first, then node1 (it becomes the primary), then node2; back when node1 is
        primary and node2 its synchronous secondary."""
        for sub in ("config", "data", "run"):
            (self.folder / sub).mkdir(exist_ok=True)
            _hand_over(self.folder / sub, self.user)
        # Created first, then run: the monitor's PostgreSQL would listen on every interface
        # ("*", pg_autoctl's default, and `create monitor` has no --listen); loopback only.
        monitor = str(self.folder / "monitor")
        self._run(["create", "monitor", *self._common("monitor", self.monitor_port)])
        self._run(
            ["config", "set", "--pgdata", monitor, "postgresql.listen_addresses", "127.0.0.1"]
        )
        self._spawn("monitor", ["run", "--pgdata", monitor])
        self._wait(lambda: self._monitor_ready(), "the monitor accepts connections")
        for name in self.NODES:
            self._spawn(
                name,
                [
                    "create", "postgres", *self._common(name, self.ports[name]),
                    "--listen", "127.0.0.1", "--name", name, "--dbname", self.database,
                    "--monitor", self.monitor_uri, "--run",
                ],
            )  # fmt: skip
            if name == self.NODES[0]:
                self.wait_states({name: "single"}, f"{name} runs alone as the primary")
        self.wait_healthy()
        with psycopg.connect(self.dsn(), autocommit=True) as conn:
            conn.execute(WRITABLE_TABLE)

    def _monitor_ready(self) -> bool:
        try:
            self.nodes()
        except psycopg.Error:
            return False
        return True

    def _monitor_conn(self) -> psycopg.Connection[Any]:
        if self._monitor is None or self._monitor.closed or self._monitor.broken:
            self._monitor = psycopg.connect(
                f"host=127.0.0.1 port={self.monitor_port} dbname=pg_auto_failover user=postgres",
                autocommit=True,
                connect_timeout=2,
            )
        return self._monitor

    def nodes(self) -> list[Node]:
        """Every node's reported and assigned state, as the monitor has them now."""
        try:
            rows = (
                self._monitor_conn()
                .execute(
                    "SELECT nodename, nodeport, reportedstate::text, goalstate::text "
                    "FROM pgautofailover.node ORDER BY nodeid"
                )
                .fetchall()
            )
        except psycopg.Error:
            if self._monitor is not None:
                self._monitor.close()
            raise
        return [Node(str(r[0]), int(r[1]), str(r[2]), str(r[3])) for r in rows]

    def _wait(self, done: Any, what: str, timeout: float = STATE_TIMEOUT) -> float:
        began = time.monotonic()
        while time.monotonic() - began < timeout:
            with contextlib.suppress(psycopg.Error):
                if done():
                    return time.monotonic() - began
            for role, process in self.processes.items():
                if process.poll() is not None and role not in self.killed:
                    raise RuntimeError(f"pg_autoctl ({role}) exited with {process.returncode}")
            time.sleep(POLL)
        raise TimeoutError(f"the formation did not reach this state in {timeout:.0f} s: {what}")

    def wait_states(
        self, states: dict[str, str], what: str, timeout: float = STATE_TIMEOUT
    ) -> float:
        """Wait until each named node reports and is assigned its state; the seconds it took."""

        def reached() -> bool:
            found = {n.name: n for n in self.nodes()}
            return all(
                name in found and found[name].state == found[name].goal == state
                for name, state in states.items()
            )

        return self._wait(reached, what, timeout)

    def primary(self) -> str:
        for node in self.nodes():
            if node.state in ("primary", "single", "wait_primary") and node.goal == node.state:
                return node.name
        raise RuntimeError(f"no primary: {self.nodes()}")

    def other(self, name: str) -> str:
        return next(n for n in self.NODES if n != name)

    def wait_healthy(self, timeout: float = STATE_TIMEOUT) -> float:
        """Wait until one node is primary and the other its secondary (synchronous again)."""

        def healthy() -> bool:
            states = sorted((n.state, n.goal) for n in self.nodes())
            return states == [("primary", "primary"), ("secondary", "secondary")]

        return self._wait(healthy, "a primary with a secondary", timeout)

    async def writable(self, name: str, within: float = 2.0) -> bool:
        """Whether node ``name`` accepts a write now: it is what libpq's
        ``target_session_attrs=read-write`` takes (not in recovery, and not
        ``default_transaction_read_only``, which pg_auto_failover keeps on while it promotes), and
        an INSERT commits there within ``within`` seconds (with a synchronous standby named, the
        commit waits for it)."""
        try:
            async with asyncio.timeout(within):
                conn = await psycopg.AsyncConnection.connect(
                    self.node_dsn(name), target_session_attrs="read-write", autocommit=True
                )
                async with conn:
                    await conn.execute(WRITABLE_INSERT)
        except (psycopg.Error, TimeoutError):
            return False
        return True

    def perform_failover(self) -> None:
        """``pg_autoctl perform failover``: the primary drains and demotes itself, the secondary
        is promoted; returns when pg_autoctl says the formation reached its new state."""
        self._run(["perform", "failover", "--pgdata", str(self.folder / "monitor")])

    def _run(self, argv: list[str]) -> None:
        """One pg_autoctl command to its end; its output goes to the commands' log."""
        log = self.folder / "commands.log"
        if log not in self.logs:
            self.logs.append(log)
        with log.open("ab") as out:
            subprocess.run(
                [self.pg_autoctl, *argv],
                cwd=self.folder,
                env=self.env,
                user=self.user,
                group=self.group,
                extra_groups=[] if self.user else None,
                stdout=out,
                stderr=subprocess.STDOUT,
                timeout=STATE_TIMEOUT,
                check=True,
            )

    def kill(self, name: str) -> None:
        """kill -9 of node ``name``: its pg_autoctl, PostgreSQL and every backend, at once."""
        self.killed.add(name)
        _kill_tree(self.processes[name])

    def restart(self, name: str) -> None:
        """Start node ``name`` again (``pg_autoctl run``): it rejoins as the secondary."""
        self.killed.discard(name)
        self._spawn(name, ["run", "--pgdata", str(self.folder / name)])

    def events(self, count: int = 40) -> list[str]:
        """The monitor's latest events, oldest first: what pg_auto_failover decided and when."""
        rows = (
            self._monitor_conn()
            .execute(
                "SELECT eventtime, nodename, reportedstate::text, goalstate::text FROM "
                "pgautofailover.event ORDER BY eventid DESC LIMIT %s",
                (count,),
            )
            .fetchall()
        )
        return [f"{r[0]:%H:%M:%S.%f} {r[1]} {r[2]} -> {r[3]}" for r in reversed(rows)]

    def stop(self) -> None:
        """SIGTERM every pg_autoctl (each stops its PostgreSQL), nodes before the monitor; SIGKILL
        whatever is left of a tree after 30 s."""
        if self._monitor is not None:
            self._monitor.close()
        for role in [*self.NODES, "monitor"]:
            process = self.processes.get(role)
            if process is None:
                continue
            left = _descendants(process.pid)
            if process.poll() is None:
                process.terminate()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(timeout=30)
            for pid in [process.pid, *left]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=30)


def formation(database: str) -> contextlib.AbstractContextManager[Formation]:
    """A started :class:`Formation` with a database ``database``."""
    return _started("pgonce-faults-failover-", lambda f: Formation(f, database))


def prepare(dsn: str) -> None:
    """pgonce's schema and the demo handler's table in the database ``dsn`` names."""
    with psycopg.connect(dsn) as conn:
        migrate(conn, DEFAULT_SCHEMA)
        conn.execute(SETUP)
        conn.commit()
