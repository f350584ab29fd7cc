"""The service's Prometheus metrics (``GET /metrics``, text format).

Two kinds: counters the service increments as things happen (deliveries by outcome, handler runs,
rows swept, relay totals), and gauges read from the database at scrape time (queue depth, oldest
pending age, dead letters, outbox lag, the tables' estimated sizes, and the health figures: stuck
claims, the retention horizon from both ends, the oldest open transaction). A scrape reads only
partial indexes (the backlogs) and PostgreSQL's statistics (the sizes, pg_stat_activity), never
the retained rows themselves, so its cost does not grow with the retention; scrape every 15 s or
more.
Metric and label names use the project's words: inbox, outbox, relay, sweeper, keys.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from datetime import datetime
from typing import ClassVar

from pgonce.core.leases import CompleterPass
from pgonce.core.outbox import OutboxBacklog
from pgonce.core.retention import HealthReport, SweepResult
from pgonce.extras import needs
from pgonce.relay import RelayStats
from pgonce.store._async.inspect import SourceStatus
from pgonce.store._async.sweeper import swept_before
from pgonce.webhooks.worker import BatchResult

with needs("server", "the pgonce service"):
    from prometheus_client import (
        CollectorRegistry,
        Counter,
        Gauge,
        Histogram,
        disable_created_metrics,
        generate_latest,
    )
    from prometheus_client.core import CounterMetricFamily, Metric
    from prometheus_client.metrics import MetricWrapperBase
    from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# The *_created series double every counter's lines and no dashboard reads them.
disable_created_metrics()  # type: ignore[no-untyped-call]
_STATUS_VALUE = {"ok": 0, "warn": 1, "fail": 2}


class _RelayCollector(Collector):
    """Relay totals, read from the running relays' own counters at scrape time."""

    #: The label names of the families this collector builds, by family name: the one place they
    #: are defined (:meth:`ServiceMetrics.label_names` reads them for the reference).
    LABELS: ClassVar[dict[str, tuple[str, ...]]] = {
        "pgonce_relay_published": (),
        "pgonce_relay_refused": (),
        "pgonce_relay_parked": (),
        "pgonce_relay_errors": (),
        "pgonce_relay_failures": ("reason",),
    }

    def __init__(self, stats: Callable[[], list[RelayStats]]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        for name, doc in (
            ("published", "Outbox rows the broker acknowledged and the relay marked published"),
            ("refused", "Outbox rows the broker refused (each counts towards parking)"),
            ("parked", "Outbox rows parked after their last attempt"),
            ("errors", "Relay batches that failed (database or broker trouble)"),
        ):
            family = CounterMetricFamily(
                f"pgonce_relay_{name}", doc, labels=self.LABELS[f"pgonce_relay_{name}"]
            )
            family.add_metric([], sum(getattr(s, name) for s in stats))
            yield family
        failures = CounterMetricFamily(
            "pgonce_relay_failures",
            "Outbox rows that failed to publish, by reason (unroutable, nacked, refused, "
            "no_answer, unavailable, ...); a row counts once per failed attempt",
            labels=self.LABELS["pgonce_relay_failures"],
        )
        totals: dict[str, int] = {}
        for s in stats:
            for reason, count in s.failures.items():
                totals[reason] = totals.get(reason, 0) + count
        for reason, count in sorted(totals.items()):
            failures.add_metric([reason], count)
        yield failures


class ServiceMetrics:
    """Every metric of one service process, in a registry of its own."""

    def __init__(self, relay_stats: Callable[[], list[RelayStats]] = list) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.deliveries = Counter(
            "pgonce_webhook_deliveries",
            "Webhook deliveries received, by source and outcome (stored, duplicate, handshake, "
            "conflict, unavailable, swept, stopping, rejected_signature, rejected_timestamp, "
            "bad_payload, too_large, unknown_source, bad_method, disconnected, error); handshake: "
            "a provider's URL check answered, nothing stored; unavailable: a 503 with "
            "Retry-After, the delivery could not be stored (the database); swept: a 503 with "
            "Retry-After, its event was being deleted by the sweeper; stopping: a 503 with "
            "Retry-After, the service's stop (SIGTERM) cut the delivery before it was answered, "
            "the provider redelivers it; disconnected: the sender went away before its body was "
            "read; error: a 500",
            ["source", "outcome"],
            registry=r,
        )
        self.delivery_seconds = Histogram(
            "pgonce_webhook_delivery_seconds",
            "Time from the request's start to its answer (verify, dedupe, store, commit)",
            ["source"],
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
            registry=r,
        )
        self.handler_runs = Counter(
            "pgonce_inbox_events_handled",
            "Inbox events the workers finished, by outcome (done, skipped, retry, dead)",
            ["outcome"],
            registry=r,
        )
        self.handler_failures = Counter(
            "pgonce_inbox_handler_failures",
            "Inbox handler runs that failed, by source and reason (the exception's class: "
            "HandlerTimeout, ForwardFailed, HandlerSwallowedError, or the handler's own)",
            ["source", "reason"],
            registry=r,
        )
        self.worker_failures = Counter(
            "pgonce_inbox_worker_failures",
            "Failures of the inbox workers' loops (each tried again on a new connection after a "
            "pause), by connection (worker: a claim loop's; listen: LISTEN's, polling meanwhile) "
            "and reason (the exception's class: DatabaseUnavailable, OperationalError, ...)",
            ["connection", "reason"],
            registry=r,
        )
        self.batch_seconds = Histogram(
            "pgonce_inbox_batch_seconds",
            "Inbox worker batches: claim, handlers and the commit that marks the events done",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=r,
        )
        self.swept = Counter(
            "pgonce_sweeper_rows_deleted",
            "Rows the sweeper deleted, by target (a failed run's committed batches included)",
            ["target"],
            registry=r,
        )
        self.sweep_failures = Counter(
            "pgonce_sweeper_failures",
            "Sweeper runs that failed (each tried again at the next tick), by reason (the "
            "exception's class: DatabaseUnavailable, PoolTimeout, ...)",
            ["reason"],
            registry=r,
        )
        self.inbox_events = Gauge(
            "pgonce_inbox_events",
            "Inbox events not handled yet, by source and status (pending, dead)",
            ["source", "status"],
            registry=r,
        )
        self.inbox_oldest_pending = Gauge(
            "pgonce_inbox_oldest_pending_seconds",
            "Age of the oldest pending inbox event, by source (queue lag)",
            ["source"],
            registry=r,
        )
        self.dead_letters = Gauge(
            "pgonce_inbox_dead_letters",
            "Dead-lettered inbox events, by source",
            ["source"],
            registry=r,
        )
        self.outbox_rows = Gauge(
            "pgonce_outbox_rows",
            "Outbox rows not published yet, by state (pending; waiting: pending in a backoff; "
            "parked)",
            ["state"],
            registry=r,
        )
        self.table_rows = Gauge(
            "pgonce_table_rows",
            "Rows in pgonce's tables (keys, inbox, outbox): PostgreSQL's estimate, not a count",
            ["table"],
            registry=r,
        )
        self.outbox_lag = Gauge(
            "pgonce_outbox_lag_seconds",
            "Age of the oldest outbox row not yet published (0 when none waits)",
            registry=r,
        )
        self.completer = Counter(
            "pgonce_completer_requests",
            "Abandoned two-phase requests the completer took over, by outcome (finished from "
            "their recovery point, failed again, retired with a stored problem answer)",
            ["outcome"],
            registry=r,
        )
        self.completer_failures = Counter(
            "pgonce_completer_failures",
            "Completer passes that failed (each tried again at the next tick), by reason (the "
            "exception's class: DatabaseUnavailable, PoolTimeout, ...)",
            ["reason"],
            registry=r,
        )
        self.stuck_phases = Gauge(
            "pgonce_health_stuck_phases",
            "Two-phase requests whose lease ran out longer than the stuck threshold ago, by the "
            "recovery point they stopped at ('' before the first)",
            ["point"],
            registry=r,
        )
        self.retired_phases = Gauge(
            "pgonce_health_retired_phases",
            "Two-phase requests the completer retired with a stored problem answer whose key is "
            "still kept, by the recovery point they stopped at ('' before the first)",
            ["point"],
            registry=r,
        )
        self.stuck_claims = Gauge(
            "pgonce_health_stuck",
            "Rows that should have finished and did not",
            ["target"],
            registry=r,
        )
        self.oldest_retained = Gauge(
            "pgonce_health_oldest_retained_seconds",
            "Age of the oldest retained row, by target and scope group ('*' for the default)",
            ["target", "group"],
            registry=r,
        )
        self.deleted_age = Gauge(
            "pgonce_health_newest_deleted_seconds",
            "Age of the newest row the sweeper deleted, by target and scope group (absent when it "
            "deleted none); below the retry horizon, a row went while its sender may retry it",
            ["target", "group"],
            registry=r,
        )
        self.overdue = Gauge(
            "pgonce_health_overdue_rows",
            "Rows past their retention still present (the sweeper's backlog)",
            ["target", "group"],
            registry=r,
        )
        self.health_status = Gauge(
            "pgonce_health_status", "Worst health finding: 0 ok, 1 warn, 2 fail", registry=r
        )
        self.sync_standby_configured = Gauge(
            "pgonce_sync_standby_configured",
            "1 when the server waits for a synchronous standby (synchronous_standby_names is set)",
            registry=r,
        )
        self.sync_standbys = Gauge(
            "pgonce_sync_standbys",
            "Standbys attached in sync (or quorum) state now; 0 while configured means that "
            "durability is reduced",
            registry=r,
        )
        self.oldest_transaction = Gauge(
            "pgonce_oldest_transaction_seconds",
            "Age of the oldest open transaction holding the MVCC horizon back in pgonce's database "
            "(0 when none): while it is open, no dead row of pgonce's tables can be reclaimed",
            registry=r,
        )
        self.xmin_age = Gauge(
            "pgonce_xmin_horizon_age",
            "Age in transaction ids of the oldest xmin held in the database (sessions, prepared "
            "transactions, replication slots)",
            registry=r,
        )
        self.up = Gauge(
            "pgonce_database_up", "1 when the last scrape could read the database", registry=r
        )
        self.read_failures = Counter(
            "pgonce_metrics_read_failures",
            "Scrapes that could not read the database's figures, by reason (no_answer: the "
            "server or the network stalled past the read's bound; else the error's class); the "
            "gauges read from the database keep their last figures",
            ["reason"],
            registry=r,
        )
        r.register(_RelayCollector(relay_stats))

    def set_inbox(self, backlog: list[SourceStatus], now: datetime) -> None:
        self.inbox_events.clear()
        self.inbox_oldest_pending.clear()
        self.dead_letters.clear()
        for row in backlog:
            self.inbox_events.labels(row.source, row.status).set(row.events)
            if row.status == "pending":
                age = max(0.0, (now - row.oldest).total_seconds())
                self.inbox_oldest_pending.labels(row.source).set(age)
            if row.status == "dead":
                self.dead_letters.labels(row.source).set(row.events)

    def set_outbox(self, backlog: OutboxBacklog, now: datetime) -> None:
        for state in ("pending", "waiting", "parked"):
            self.outbox_rows.labels(state).set(getattr(backlog, state))
        oldest = backlog.oldest_pending
        self.outbox_lag.set(max(0.0, (now - oldest).total_seconds()) if oldest else 0.0)

    def set_tables(self, estimates: dict[str, int]) -> None:
        self.table_rows.clear()
        for table, rows in estimates.items():
            self.table_rows.labels(table).set(rows)

    def set_health(self, report: HealthReport) -> None:
        self.stuck_claims.clear()
        self.oldest_retained.clear()
        self.overdue.clear()
        self.deleted_age.clear()
        self.stuck_phases.clear()
        self.retired_phases.clear()
        for stuck in report.stuck:
            self.stuck_claims.labels(stuck.target).set(stuck.count)
            for point, count in stuck.phases:
                self.stuck_phases.labels(point).set(count)
            for point, count in stuck.retired:
                self.retired_phases.labels(point).set(count)
        for group in report.groups:
            label = group.scope or "*"
            age = group.oldest_age.total_seconds() if group.oldest_age else 0.0
            self.oldest_retained.labels(group.target, label).set(age)
            self.overdue.labels(group.target, label).set(group.overdue)
            if group.deleted_age is not None:
                self.deleted_age.labels(group.target, label).set(group.deleted_age.total_seconds())
        self.health_status.set(_STATUS_VALUE[report.status])
        if report.mvcc is not None:
            oldest = report.mvcc.oldest
            self.oldest_transaction.set(oldest.total_seconds() if oldest else 0.0)
            self.xmin_age.set(report.mvcc.xmin_age)
        if report.durability is not None:
            self.sync_standby_configured.set(int(report.durability.configured))
            self.sync_standbys.set(report.durability.synchronous)

    def record_batch(self, result: BatchResult, seconds: float) -> None:
        for outcome, count in (
            ("done", result.done),
            ("skipped", result.skipped),
            ("retry", result.retried),
            ("dead", result.dead),
        ):
            if count:
                self.handler_runs.labels(outcome).inc(count)
        self.batch_seconds.observe(seconds)

    def record_handler_failure(self, source: str, reason: str) -> None:
        self.handler_failures.labels(source, reason).inc()

    def record_worker_failure(self, connection: str, error: Exception) -> None:
        self.worker_failures.labels(connection, type(error).__name__).inc()

    def record_sweep(self, result: SweepResult) -> None:
        for swept in result.targets:
            self.swept.labels(swept.target).inc(swept.deleted)

    def record_sweep_failure(self, error: Exception) -> None:
        self.sweep_failures.labels(type(error).__name__).inc()
        # The batches a failed run committed before its failure stay deleted: counted too.
        for target, deleted in (swept_before(error) or {}).items():
            self.swept.labels(target).inc(deleted)

    def record_read_failure(self, reason: str) -> None:
        self.read_failures.labels(reason).inc()

    def record_completer(self, done: CompleterPass) -> None:
        for outcome in ("finished", "failed", "retired"):
            self.completer.labels(outcome).inc(getattr(done, outcome))

    def record_completer_failure(self, error: Exception) -> None:
        self.completer_failures.labels(type(error).__name__).inc()

    def label_names(self) -> dict[str, tuple[str, ...]]:
        """Every metric family's label names, by family name (without ``_total``): the counters',
        gauges' and histograms' of this registry and the relay collector's."""
        names = {
            metric._name: tuple(metric._labelnames)
            for metric in vars(self).values()
            if isinstance(metric, MetricWrapperBase)
        }
        names.update(_RelayCollector.LABELS)
        return names

    def answered(self) -> list[tuple[str, str, int]]:
        """Webhook deliveries answered since the process started: (source, outcome, count)."""
        return sorted(
            (sample.labels["source"], sample.labels["outcome"], int(sample.value))
            for metric in self.deliveries.collect()
            for sample in metric.samples
            if sample.name.endswith("_total")
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)


# Keep the public surface small and typed.
__all__ = ["CONTENT_TYPE", "ServiceMetrics"]
