"""Check pgonce's health and print it as a table: stuck claims and the retention horizon.

- stuck claims: claims committed without a response and older than --stuck-after. A handful, and
  recent, is normal; an old one answers every retry of its key "in flight" until someone acts.
- oldest row vs retry horizon: no row may be deleted while its sender may still retry it. The
  sweeper notes the newest row it deleted (sweep_marks); one younger than the retry horizon fails.
  A young oldest row with nothing deleted that young is a young table, and passes.
- oldest row vs retention: the oldest completed key must be younger than retention + --slack, else
  the sweeper stalled.
- overdue rows: rows past their retention, still waiting for the sweeper.
- sync standby: with synchronous_standby_names set, whether a standby is attached in sync now; a
  warning when none is (after a failover, until the old node returns): durability is reduced.
- listen: whether LISTEN reaches the server directly. Through a transaction-mode pooler it
  receives nothing, and the inbox and outbox fall back to polling: give $PGONCE_LISTEN_DSN (or
  [database] listen_dsn) a direct connection.
- failed rows: outbox rows the broker refused (waiting for a retry, or parked) and inbox events
  whose handler failed (retrying, or dead), by aggregate type or source, with the newest reason.
  Parked and dead rows wait for a person: fix the cause, then `pgonce replay`.

Give the same retention options (or the same --config) as `pgonce sweep` so that both judge by the
same policy.
Every query is bounded: --timeout is the server's statement timeout, and twice it the wall-time
bound that ends a read on a stalled network (the server's error never comes back there), with one
line saying which read got no answer.
Exit status: 0 when every check passes or only warns, 1 when a check fails (also warnings, and
parked or dead rows, with --strict) or the database cannot be read in time.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import replace

from pgonce.cli.common import (
    add_database_options,
    announced_database,
    command_connection,
    config_from,
    printable,
    settings_from,
)
from pgonce.cli.sweep import (
    add_retention_options,
    age_arg,
    policies_from,
    statement_timeout_arg,
)
from pgonce.core.retention import (
    DEFAULT_HEALTH_TIMEOUT,
    DEFAULT_SLACK,
    DEFAULT_STUCK_AFTER,
    Finding,
    HealthReport,
    format_duration,
)
from pgonce.core.topology import judge_listen
from pgonce.database import POLLING_COST, shares_server_sessions
from pgonce.store._sync.health import HealthCheck
from pgonce.store._sync.inspect import Inspector, Trouble
from pgonce.store.errors import translate_errors

NAME = "doctor"
HELP = "check stuck claims and the retention horizon; exit 1 when something is wrong"

COLUMNS = ("check", "target", "scope", "value", "limit", "status")


def configure(parser: argparse.ArgumentParser) -> None:
    add_database_options(parser)
    add_retention_options(parser)
    group = parser.add_argument_group("thresholds")
    group.add_argument(
        "--stuck-after",
        type=age_arg,
        default=DEFAULT_STUCK_AFTER,
        metavar="DURATION",
        help="a claim in flight longer than this is stuck "
        f"(default {format_duration(DEFAULT_STUCK_AFTER)}: longer than any handler should run)",
    )
    group.add_argument(
        "--slack",
        type=age_arg,
        default=DEFAULT_SLACK,
        metavar="DURATION",
        help="how far the oldest row may outlive its retention before the sweeper counts as "
        f"stalled (default {format_duration(DEFAULT_SLACK)}: a nightly cron that missed a night)",
    )
    group.add_argument(
        "--timeout",
        # PostgreSQL's bound, said at the call: above it the check's own error named the sweep.
        type=statement_timeout_arg,
        default=DEFAULT_HEALTH_TIMEOUT,
        metavar="DURATION",
        help="statement timeout of the checks' queries; a query without an answer for twice "
        "this (a stalled server or network) ends the check with an error "
        f"(default {format_duration(DEFAULT_HEALTH_TIMEOUT)})",
    )
    parser.add_argument("--strict", action="store_true", help="exit 1 on warnings too")


def render(report: HealthReport) -> str:
    """The report as an aligned text table, with the reasons for every finding that is not ok."""
    rows = [COLUMNS, *(_cells(f) for f in report.findings)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    lines = [_line(row, widths) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    notes = [
        f"{f.status.upper()} {f.check} ({f.target}, {_scope(f)}): {f.detail}"
        for f in report.findings
        if f.status != "ok" and f.detail
    ]
    checked = f"checked at {report.checked_at:%Y-%m-%d %H:%M:%S %Z}: {report.status.upper()}"
    return "\n".join([*lines, "", *notes, *([""] if notes else []), checked])


def render_troubles(troubles: Sequence[Trouble]) -> str:
    """Failed rows, one line per group, each with what happens next and its newest reason."""
    if not troubles:
        return "failed rows: none (no refused outbox row, no failed inbox event)"
    lines = ["failed rows:"]
    for t in troubles:
        what = "aggregate type" if t.part == "outbox" else "source"
        if t.next_attempt_at is not None:
            next_step = f"next attempt {t.next_attempt_at:%Y-%m-%d %H:%M:%S %Z}"
        else:
            option = "--outbox --aggregatetype" if t.part == "outbox" else "--source"
            next_step = f"waiting for `pgonce replay {option} {t.name}` after a fix"
        lines.append(
            f"  {t.part} {what} {t.name!r}: {t.rows} {t.state} ({next_step}); "
            f"last error: {printable(t.last_error or 'none recorded')}"
        )
    return "\n".join(lines)


def _line(cells: Sequence[str], widths: Sequence[int]) -> str:
    return "  ".join(cell.ljust(width) for cell, width in zip(cells, widths, strict=True)).rstrip()


def _scope(finding: Finding) -> str:
    return "*" if finding.scope is None else finding.scope


def _cells(finding: Finding) -> Sequence[str]:
    status = finding.status if finding.status == "ok" else finding.status.upper()
    return (finding.check, finding.target, _scope(finding), finding.value, finding.limit, status)


def run(args: argparse.Namespace) -> int:
    config = config_from(args)
    settings = settings_from(args, config)
    health = HealthCheck(
        policies_from(args, config),
        schema=settings.schema,
        targets=args.target,
        stuck_after=args.stuck_after,
        slack=args.slack,
        timeout=args.timeout,
    )
    with (
        announced_database(settings) as db,
        translate_errors("connecting"),
        command_connection(db.dsn) as conn,
    ):
        report = health.check(conn, now=args.now)
        # Bounded as the health check is: on a stalled network it waited for good.
        troubles = Inspector(schema=settings.schema, timeout=health.deadline).troubles(conn)
        listen_dsn = settings.listen_dsn
        listening = judge_listen(
            POLLING_COST,
            pooled=shares_server_sessions(db.dsn),
            listen_given=listen_dsn is not None,
            listen_pooled=listen_dsn is not None and shares_server_sessions(listen_dsn),
        )
        report = replace(report, findings=(*report.findings, listening))
    # The failed rows before the verdict line, which stays last.
    table, verdict = render(report).rsplit("\n", 1)
    print("\n".join([table, render_troubles(troubles), "", verdict]))
    stuck = any(t.state in ("parked", "dead") for t in troubles)
    if report.status == "fail" or (args.strict and (report.status == "warn" or stuck)):
        return 1
    return 0
