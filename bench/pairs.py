"""An adapter's app with pgonce against the same app without it: one round's measurement, and the
side-by-side table with the issue's target (>= 85 %), shared by the adapters' workloads."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from pathlib import Path

import psycopg

from bench.report import Table, Targets, percentile, ratio
from bench.servers import ROOT, cpu_seconds, database_cpu, database_cpu_spent, database_pids
from bench.workloads.http_middleware import SLICE, Result, load, paired, probe, round_ratios

#: The two variants every adapter's workload compares: the app alone, and behind pgonce.
VARIANTS = ("none", "pgonce")
#: The variant that does pgonce's writes by hand (bench.by_hand), where a workload has one.
LIMIT = "hand"
#: The app between the key store's begin() and commit() with none of the middleware's logic,
#: where a workload has it: the limit of any middleware on the one-transaction design.
STATEMENTS = "statements"
STATEMENTS_LABEL = "the key store's statements alone (no middleware logic)"
TARGET = 0.85


def prepare_payments(dsn: str, table: str) -> None:
    """An empty payments table (the apps' one write per request) named ``table``."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            f"CREATE TABLE IF NOT EXISTS {table} (id bigserial PRIMARY KEY,"
            " principal text NOT NULL, amount bigint NOT NULL, currency text NOT NULL)".encode()
        )
        conn.execute(f"TRUNCATE {table}".encode())


def cleanup_payments(dsn: str, schema: str, scope: str, table: str) -> None:
    """Forget the run's keys (of ``scope``) and payments."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"DELETE FROM {schema}.keys WHERE scope = %s".encode(), (scope,))
        conn.execute(f"TRUNCATE {table}".encode())


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as children:
            return [int(child) for child in children.read().split()]
    except OSError:
        return []


@contextlib.contextmanager
def gunicorn(
    app: str, env: Mapping[str, str], log: Path, *, workers: int = 2, threads: int = 4
) -> Iterator[tuple[list[int], list[int]]]:
    """``workers`` gunicorns of one gthread worker each serving the WSGI ``app``
    (``module:callable()``) with ``env`` added to the environment, each on a socket bound here;
    yields (their ports, pids of masters and workers).

    One master per worker, so that the load's connections are spread evenly (:func:`load` deals
    them out over the ports): the workers of one master race for each connection as it arrives,
    and a keep-alive connection stays with the worker that won it. Eight connections opened at
    once all went to one worker, ten times out of ten; under load the split changed from one
    burst of connections to the next (the two workers' CPU 0.8 and 0.7 s in one 2 s burst, 0.7
    and 0.3 s in another, at 960 and 520 requests/s), and with it the round's throughput.
    """
    with contextlib.ExitStack() as stack:
        started = [stack.enter_context(_gunicorn(app, env, log, threads)) for _ in range(workers)]
        yield [port for port, _ in started], [pid for _, pids in started for pid in pids]


@contextlib.contextmanager
def _gunicorn(
    app: str, env: Mapping[str, str], log: Path, threads: int
) -> Iterator[tuple[int, list[int]]]:
    """One gunicorn of one gthread worker; yields its port and the pids of master and worker."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(1024)
    port = int(sock.getsockname()[1])
    command = [
        sys.executable,
        "-m",
        "gunicorn",
        "--bind",
        f"fd://{sock.fileno()}",
        "--worker-class",
        "gthread",
        "--workers",
        "1",
        "--threads",
        str(threads),
        "--no-control-socket",
        app,
    ]
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
        deadline = time.monotonic() + 30
        while not _children(process.pid) or not _accepts(port):
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"gunicorn for {app} did not start; see {log}")
            time.sleep(0.05)
        yield port, [process.pid, *_children(process.pid)]
    finally:
        forked = _children(process.pid)
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            # A master killed before its graceful stop leaves its workers running, each holding
            # its pool's connections and taking CPU from the next variant's rounds.
            for pid in forked:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


def _accepts(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
        return True
    return False


def _slice(
    ports: list[int], server_pids: list[int], database: list[int], seconds: float, concurrency: int
) -> Result:
    """``seconds`` of load on a started server, with the CPU it and PostgreSQL spent on it."""
    server_before, database_before = cpu_seconds(server_pids), database_cpu(database)
    result = asyncio.run(load(ports, seconds, concurrency))
    result.server_cpu = cpu_seconds(server_pids) - server_before
    result.database_cpu = database_cpu_spent(database_before)
    return result


#: Starts one variant's server; yields its ports and the processes whose CPU is the server's.
Serve = Callable[[str], AbstractContextManager[tuple[list[int], list[int]]]]


def alternate(
    variants: Sequence[str],
    serve: Serve,
    dsn: str,
    *,
    rounds: int,
    seconds: float,
    concurrency: int,
) -> tuple[list[dict[str, Result]], dict[str, str]]:
    """``rounds`` rounds of every variant; the results per round, and what a retry got from each
    variant.

    Every variant's server runs for the whole measurement, each warmed up first; then the
    variants take turns, ``SLICE`` seconds of load each, every other turn in the opposite
    order, until each had ``seconds`` in the round. A neighbour's burst or a drift of the
    machine's speed then lands on every variant of a round alike, where one variant's seconds
    after another's would each meet their own.
    """
    slices = max(1, round(seconds / SLICE))
    runs: list[dict[str, Result]] = []
    with contextlib.ExitStack() as stack:
        servers = {variant: stack.enter_context(serve(variant)) for variant in variants}
        for ports, _ in servers.values():
            asyncio.run(load(ports, min(1.0, seconds), concurrency))  # warm-up: pools, caches
        database = database_pids(dsn)
        for number in range(rounds):
            order = list(variants if number % 2 == 0 else variants[::-1])
            totals = {variant: Result() for variant in variants}
            for turn in range(slices):
                for variant in order if turn % 2 == 0 else order[::-1]:
                    ports, pids = servers[variant]
                    part = _slice(ports, pids, database, seconds / slices, concurrency)
                    totals[variant].add(part)
            runs.append(totals)
        probes = {v: asyncio.run(probe(ports[0])) for v, (ports, _) in servers.items()}
    return runs, probes


def served(workers: int, threads: int, concurrency: int, rounds: int, seconds: float) -> str:
    """How :func:`gunicorn` served and :func:`alternate` measured, for a workload's notes."""
    turn = seconds / max(1, round(seconds / SLICE))
    return (
        f"{workers} gunicorns of one gthread worker x {threads} threads each, "
        f"{concurrency // workers} of the {concurrency} keep-alive client connections on each "
        "(the workers of one gunicorn race for connections, and one of them may win all of "
        f"them); a new key on every request; every variant's servers running throughout, "
        f"{rounds} round(s) of {seconds:g} s per variant in turns of {turn:g} s interleaved "
        "across the variants, each variant's best round."
    )


def compare(
    title: str,
    labels: Mapping[str, str],
    runs: Sequence[Mapping[str, Result]],
    probes: Mapping[str, str],
    notes: Sequence[str],
) -> list[Table]:
    """The table of both variants' best rounds, and the target's table: pgonce's throughput
    against the app alone's, on the best rounds and on the median of the rounds' ratios."""
    # Every variant labelled (the pair, and any reference a workload adds beside it).
    best = {v: max((r[v] for r in runs), key=lambda result: result.rps) for v in labels}
    ratios = round_ratios(runs, "pgonce", "none")
    reference = best["none"]
    table = Table(
        title,
        [
            "variant",
            "requests/s",
            "p50 ms",
            "p99 ms",
            "throughput",
            "server CPU µs/req",
            "PostgreSQL CPU µs/req",
            "answers",
            "retry",
        ],
    )
    for variant in labels:
        result = best[variant]
        table.add(
            labels[variant],
            f"{result.rps:,.0f}",
            f"{percentile(result.latencies, 50) * 1000:.1f}",
            f"{percentile(result.latencies, 99) * 1000:.1f}",
            ratio(result.rps, reference.rps, labels["none"]),
            result.per_request_us(result.server_cpu),
            result.per_request_us(result.database_cpu),
            ", ".join(f"{n}x{s}" for s, n in sorted(result.statuses.items())),
            probes.get(variant, "?"),
        )
    table.notes.extend(notes)
    mine, alone = labels["pgonce"], labels["none"]
    targets = Targets(
        f"{title}: the issue's target", f"{mine} against the same app without it, from above."
    )
    targets.table.notes.append(
        "Round by round: " + ", ".join(f"{100 * r:.0f}" for r in ratios) + " %."
    )
    targets.at_least(f"{mine} vs {alone}, best rounds", best["pgonce"].rps / reference.rps, TARGET)
    if ratios:
        targets.at_least(f"{mine} vs {alone}, median round", statistics.median(ratios), TARGET)
    if LIMIT in labels:
        targets.table.notes.append(_limit(labels, runs))
    return [table, targets.table]


def _limit(labels: Mapping[str, str], runs: Sequence[Mapping[str, Result]]) -> str:
    """The app doing pgonce's writes itself (bench.by_hand) against the app alone, and pgonce
    against it."""
    return limit_note(
        labels,
        runs,
        LIMIT,
        f"A key by hand: {labels[LIMIT]} (pgonce's rows and round trips written by hand through "
        "psycopg, none of pgonce's code)",
    )


def best_ratio(runs: Sequence[Mapping[str, Result]], top: str, bottom: str) -> float:
    """``top``'s best round over ``bottom``'s best round."""
    return max(r[top].rps for r in runs) / max(r[bottom].rps for r in runs)


def against(runs: Sequence[Mapping[str, Result]], top: str, bottom: str, of: str = "") -> str:
    """``top`` against ``bottom``: "N % [of <of>] (best rounds; median round M %)"."""
    of_text = f" of {of}" if of else ""
    return (
        f"{100 * best_ratio(runs, top, bottom):.0f} %{of_text} (best rounds; median round "
        f"{100 * (paired(runs, top, bottom) or 0.0):.0f} %)"
    )


def limit_note(
    labels: Mapping[str, str],
    runs: Sequence[Mapping[str, Result]],
    limit: str,
    subject: str,
    why: str = "",
    mine: str = "",
) -> str:
    """A target's limit in the target table's notes: the ``limit`` variant against the app
    alone, then pgonce against that variant, each on the best rounds and the median round."""
    return (
        f"{subject} runs at {against(runs, limit, 'none', labels['none'])}{why}. "
        f"{labels['pgonce']} against it: {against(runs, 'pgonce', limit)}{mine}."
    )


def design_limit(
    labels: Mapping[str, str],
    runs: Sequence[Mapping[str, Result]],
    adds: str = "cost the app in the database",
) -> str:
    """The target's note on the :data:`STATEMENTS` variant: the app's ratio to it, and pgonce's."""
    return limit_note(
        labels,
        runs,
        STATEMENTS,
        f"The design's limit: {labels[STATEMENTS]}",
        f": what the claim and the stored response {adds} with the least Python around them; no "
        "middleware on the key store does better",
        ", what the middleware's own logic costs",
    )
