"""The soak report: a table per phase with the issue's targets beside the measured values, the
pgqueuer comparison, and PNG plots (latency, depth, table and index sizes over time, phase
boundaries marked). Every figure is measured in the run; "met" is computed, never typed.

Targets (issue #33), judged against the first baseline phase ("clean"):

- idle-in-tx: every path keeps ≥ 80 % of its clean throughput, and p99 ≤ 3 × clean;
- recovery: every path back within 10 % of its clean p99 (over 5-second windows) within 5
  minutes of the recovery's start;
- high-load: no error (no 500, nothing lost); the queue depth grows no faster than the excess
  rate; the depth drains by the end of the next recovery;
- active-readers, pg-backend-kill, pool-exhaustion: no lost, no doubled, no 500;
- every phase: no lost, no doubled.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from faults.soak.histogram import LogHistogram
from faults.soak.run import PATHS, PICKUP, PhaseRun, Sample
from faults.soak.scenario import SoakRun

#: Paths with a queue whose depth the sampler reads.
QUEUED = ("inbox", "outbox", "pgqueuer")
PGONCE_PATHS = tuple(p for p in PATHS if p != "pgqueuer")
RECOVERY_WITHIN = 300.0
WINDOW = 5


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f}"


def _size(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}"
        n /= 1024
    return f"{n:.1f} TB"


def _samples(samples: list[Sample], run: PhaseRun) -> list[Sample]:
    return [s for s in samples if run.began <= s.at < run.ended]


def _depths(samples: list[Sample], path: str) -> tuple[int, int, int]:
    values = [s.depth[path] for s in samples] or [0]
    return values[0], values[-1], max(values)


def _met(held: bool) -> str:
    return "yes" if held else "**no**"


class Judge:
    """The targets of one phase, as rows "figure | target | measured | met"."""

    def __init__(self, soak: SoakRun) -> None:
        self.soak = soak
        self.clean = next((r for r in soak.phases if r.phase.name == "baseline"), None)
        self.rows: list[tuple[str, str, str, bool]] = []

    def add(self, figure: str, target: str, measured: str, held: bool) -> None:
        self.rows.append((figure, target, measured, held))

    def phase(self, run: PhaseRun) -> list[tuple[str, str, str, bool]]:
        self.rows = []
        name = run.phase.name
        paths = PATHS
        for path in paths:
            self.add(
                f"{path}: lost, doubled",
                "0, 0",
                f"{run.lost[path]}, {run.doubled[path]}",
                run.lost[path] == 0 and run.doubled[path] == 0,
            )
        five = sum(
            n
            for s, n in run.statuses.items()
            if s.rsplit(" ", 1)[-1].startswith("5") and not s.endswith("503")
        )
        if name in ("active-readers", "pg-backend-kill", "pool-exhaustion", "high-load"):
            self.add("pgonce: answers 500 (503 allowed)", "0", str(five), five == 0)
        clean = self.clean
        if clean is not None and name == "idle-in-tx":
            for path in paths:
                base = clean.completed[path] / clean.seconds
                now = run.completed[path] / run.seconds
                self.add(
                    f"{path}: throughput vs clean",
                    "≥ 80 %",
                    f"{now:.1f}/s vs {base:.1f}/s",
                    base > 0 and now >= 0.8 * base,
                )
                p99, c99 = run.latency[path].percentile(99), clean.latency[path].percentile(99)
                self.add(
                    f"{path}: p99 vs clean",
                    "≤ 3 ×",
                    f"{_ms(p99)} ms vs {_ms(c99)} ms",
                    p99 is not None and c99 is not None and p99 <= 3 * c99,
                )
        if clean is not None and name == "high-load":
            samples = _samples(self.soak.samples, run)
            for path in QUEUED:
                first, last, _ = _depths(samples, path)
                growth = (last - first) / run.seconds
                excess = run.rate - clean.completed[path] / clean.seconds
                self.add(
                    f"{path}: depth growth",
                    f"≤ excess rate {max(excess, 0):.1f}/s",
                    f"{growth:.2f}/s ({first} → {last})",
                    growth <= max(excess, 0) + 0.5,
                )
            later = [r for r in self.soak.phases[run.index + 1 :] if r.phase.name == "recovery"]
            if later:
                recovered = _samples(self.soak.samples, later[0])
                clean_samples = _samples(self.soak.samples, clean)
                for path in QUEUED:
                    _, end, _ = _depths(recovered, path)
                    _, _, clean_max = _depths(clean_samples, path)
                    self.add(
                        f"{path}: drained by the end of {later[0].label}",
                        f"≤ clean max {clean_max}",
                        str(end),
                        end <= max(clean_max, 1),
                    )
        if clean is not None and name == "recovery":
            for path in paths:
                back = self.returned(run, clean, path)
                self.add(
                    f"{path}: p99 back within 10 % of clean",
                    f"within {RECOVERY_WITHIN / 60:.0f} min",
                    "not within the phase" if back is None else f"after {back:.0f} s",
                    back is not None and back <= RECOVERY_WITHIN,
                )
        return self.rows

    def returned(self, run: PhaseRun, clean: PhaseRun, path: str) -> float | None:
        """Seconds from the recovery's start to the first 5-second window whose p99 is within
        10 % of clean and stays so for the rest of the phase (the per-second windows merged)."""
        c99 = clean.latency[path].percentile(99)
        samples = _samples(self.soak.samples, run)
        if c99 is None or not samples:
            return None
        # The per-second p99s are all the plots keep; a window's p99 is their maximum.
        ok_from: float | None = None
        for i in range(0, max(len(samples) - WINDOW + 1, 1)):
            window = [s.p99[path] for s in samples[i : i + WINDOW] if s.p99[path] is not None]
            good = bool(window) and max(v for v in window if v is not None) <= 1.1 * c99
            if good and ok_from is None:
                ok_from = samples[i].at - run.began
            elif not good:
                ok_from = None
        return ok_from


def bloated(soak: SoakRun, run: PhaseRun, top: int = 3) -> list[str]:
    """The relations that grew most in ``run``: their growth and dead tuples at its end."""
    samples = _samples(soak.samples, run)
    if len(samples) < 2:
        return []
    first, last = samples[0].relations, samples[-1].relations
    growth = sorted(((last[k][0] - first.get(k, (0, None))[0], k) for k in last), reverse=True)[
        :top
    ]
    return [
        f"`{k}` +{_size(g)} (now {_size(last[k][0])}"
        + (f", {last[k][1]} dead tuples)" if last[k][1] is not None else ")")
        for g, k in growth
        if g > 0
    ]


ADVICE = (
    "pgonce's part: the inbox and the key store leave room on each page for a row's next version "
    "(fillfactor 80) so that the done mark and the completion are HOT updates; the claim indexes "
    "are partial (pending rows only), so a pinned horizon bloats the heap and the age indexes "
    "more than the claim path; the sweeper deletes in bounded batches. What no schema can do is "
    "reclaim rows while a transaction pins the horizon: set `idle_in_transaction_session_timeout` "
    "and watch the oldest transaction's age (docs/how-to/long-running.md)."
)


def render(soak: SoakRun, *, header: list[str], seconds: float, plots: list[Path]) -> str:
    judge = Judge(soak)
    r = soak.result
    lines = [
        *header,
        f"Took {seconds / 60:.1f} minutes. Profile: {soak.profile.what}. Everything runs on "
        "loopback against the real service processes and a PostgreSQL the run starts itself "
        "(embedded, temporary data folder, `max_connections` raised for the pool-exhaustion "
        "phase), never a shared server; the broker is a redis-server of the run's own.",
        "",
        f"**pgonce: {'pass' if r.passed else 'FAIL'}** (sent {r.acc.sent}, lost {r.acc.lost}, "
        f"doubled {r.acc.doubled}, 500 {r.acc.http_500}, 503 {r.acc.http_503}); "
        f"**pgqueuer**: sent {soak.pgq.sent}, lost {soak.pgq.lost}, doubled {soak.pgq.doubled}.",
        "",
        "Paths: *payments* = POST /payments with an Idempotency-Key on the example app, latency "
        "from the request's sending to the 201 (retries included); *webhooks* = a signed "
        "delivery to `pgonce serve`, to its 200; *inbox* = the same events' pickup, from the "
        "storing transaction to the start of the worker transaction that ran the handler; "
        "*outbox* = an enqueue's commit to "
        "the broker's acknowledgement; *pgqueuer* = a no-op job's enqueue to its start. The load "
        "is open-loop: arrivals keep their schedule whatever the system does (*offered /s* is "
        "what the sending achieved; each phase says how far it fell behind its schedule). "
        "Latencies: log-bucket histograms (1 % precision, bounded memory).",
        "",
        "## Phases side by side",
        "",
        "| phase | seconds | pgonce inbox /s | inbox p99 ms | outbox /s | outbox p99 ms "
        "| pgqueuer /s | pgqueuer p99 ms | oldest xact s (max) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for run in soak.phases:
        oldest = max((s.oldest_xact_seconds for s in _samples(soak.samples, run)), default=0.0)
        cells = [run.label, f"{run.seconds:.0f}"]
        for path in ("inbox", "outbox", "pgqueuer"):
            cells += [
                f"{run.completed[path] / run.seconds:.1f}",
                _ms(run.latency[path].percentile(99)),
            ]
        lines.append("| " + " | ".join([*cells, f"{oldest:.0f}"]) + " |")
    lines.append("")
    for run in soak.phases:
        lines += _phase(soak, run, judge)
    lines += ["## Plots", ""]
    lines += [f"![{p.stem}]({p.name})" for p in plots]
    lines += ["", "## Checks (the fault report's)", ""]
    lines += [f"- {'✔' if held else '✘ **failed**'} {what}" for what, held in r.checks]
    lines += [f"- note: {note}" for note in [*r.acc.notes, *soak.pgq_notes]]
    lines.append("")
    return "\n".join(lines)


def _phase(soak: SoakRun, run: PhaseRun, judge: Judge) -> list[str]:
    samples = _samples(soak.samples, run)
    lines = [
        f"## {run.label}",
        "",
        f"{run.phase.what}. Offered {run.rate:g}/s per path for {run.seconds:.0f} s; the "
        f"sending fell behind its schedule by at most {max(run.lag.values()):.1f} s."
        + (f" Fault: {'; '.join(run.fault.notes)}." if run.fault.notes else ""),
        "",
        "| path | offered /s | achieved /s | p50 ms | p95 ms | p99 ms | depth start → end (max) "
        "| lost | doubled |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for path in PATHS:
        h: LogHistogram = run.latency[path]
        depth = "-"
        if path in QUEUED:
            first, last, top = _depths(samples, path)
            depth = f"{first} → {last} ({top})"
        offered = run.offered[path if path != "inbox" else "webhooks"] / run.seconds
        lines.append(
            f"| {path}{' (pickup)' if path in PICKUP else ''} | {offered:.1f} | "
            f"{run.completed[path] / run.seconds:.1f} | {_ms(h.percentile(50))} | "
            f"{_ms(h.percentile(95))} | {_ms(h.percentile(99))} | {depth} | {run.lost[path]} | "
            f"{run.doubled[path]} |"
        )
    statuses = ", ".join(f"{s}: {n}" for s, n in sorted(run.statuses.items())) or "none"
    waits: Counter[str] = Counter()
    for s in samples:
        waits.update(s.waits)
    common = ", ".join(f"{w} {n / max(len(samples), 1):.1f}" for w, n in waits.most_common(6))
    lines += [
        "",
        f"- answers: {statuses}",
        f"- wait events (active backends, mean per 1 s sample): {common or 'none'}",
    ]
    grew = bloated(soak, run)
    if grew:
        lines.append(f"- grew most: {'; '.join(grew)}")
    rows = judge.phase(run)
    lines += ["", "| figure | target | measured | met |", "|---|---|---|---|"]
    lines += [f"| {f} | {t} | {m} | {_met(h)} |" for f, t, m, h in rows]
    missed = [f for f, _, _, held in rows if not held]
    if missed:
        lines += [
            "",
            f"Missed: {', '.join(missed)}. "
            + (f"Bloated in this phase: {'; '.join(grew)}. " if grew else "")
            + ADVICE,
        ]
    lines.append("")
    return lines


def plot(soak: SoakRun, folder: Path, stem: str) -> list[Path]:
    """One PNG: p99 per second, queue depth, the largest relations' sizes, dead tuples."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = soak.samples
    if not samples:
        return []
    t0 = soak.phases[0].began
    xs = [s.at - t0 for s in samples]
    fig, axes = plt.subplots(4, 1, figsize=(11, 13), sharex=True)
    lat, depth, size, dead = axes
    for path in PATHS:
        ys = [_plotted_ms(s.p99[path]) for s in samples]
        lat.plot(xs, ys, label=path, linewidth=1)
    lat.set_yscale("log")
    lat.set_ylabel("p99 per second (ms)")
    for path in QUEUED:
        depth.plot(xs, [s.depth[path] for s in samples], label=path, linewidth=1)
    depth.set_ylabel("queue depth (rows)")
    final = samples[-1].relations
    largest = sorted(final, key=lambda k: final[k][0], reverse=True)[:8]
    for rel in largest:
        ys = [s.relations.get(rel, (0, None))[0] / 1024 for s in samples]
        size.plot(xs, ys, label=rel, linewidth=1)
    size.set_ylabel("size (kB)")
    tables = [k for k in final if final[k][1] is not None]
    for rel in sorted(tables, key=lambda k: final[k][1] or 0, reverse=True)[:6]:
        ys = [float(s.relations.get(rel, (0, 0))[1] or 0) for s in samples]
        dead.plot(xs, ys, label=rel, linewidth=1)
    dead.plot(xs, [s.oldest_xact_seconds for s in samples], "k:", label="oldest xact (s)")
    dead.set_ylabel("dead tuples")
    dead.set_xlabel("seconds since the start")
    for ax in axes:
        for run in soak.phases:
            ax.axvline(run.began - t0, color="grey", linestyle="--", linewidth=0.8)
        ax.legend(fontsize=7, loc="upper left")
        ax.grid(alpha=0.3)
    for run in soak.phases:
        lat.text(
            run.began - t0,
            1.02,
            run.phase.name,
            transform=lat.get_xaxis_transform(),
            fontsize=7,
            rotation=20,
        )
    fig.tight_layout()
    png = folder / f"{stem}.png"
    fig.savefig(png, dpi=80)
    plt.close(fig)
    return [png]


def _plotted_ms(value: float | None) -> float:
    return float("nan") if value is None else value * 1000
