"""End to end through the real service process: `pgonce serve` on a free loopback port.

Signed deliveries with storms and duplicates, handler effects checked in the database, metrics
checked on /metrics, the admin page behind its token, and SIGTERM in the middle of a burst: every
acknowledged delivery is stored and, after a restart, handled exactly once.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import psycopg
import pytest

from pgonce.webhooks.schemes import build_scheme

ROOT = Path(__file__).resolve().parents[2]
SECRET = "whsec_C2FVsBQIhrscChlQIMV+b5sSYspob7oD"
TOKEN = "admin-t0ken-for-tests"
CONFIG = """
[server]
log_format = "json"
[inbox]
workers = 2
[admin]
token = "env:TEST_ADMIN_TOKEN"
[sources.shop]
scheme = "standard-webhooks"
secrets = ["env:TEST_SHOP_SECRET"]
handler = "pgonce.service.demo:record_order"
"""
SCHEME = build_scheme("standard-webhooks", SECRET)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Service:
    process: subprocess.Popen[str]
    url: str
    log: Path

    def stop(self) -> int:
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=60)


def start(dsn: str, tmp_path: Path, config: str = CONFIG) -> Service:
    path = tmp_path / "pgonce.toml"
    path.write_text(config)
    port = free_port()
    log = tmp_path / f"service-{port}.log"
    env = {**os.environ, "TEST_SHOP_SECRET": SECRET, "TEST_ADMIN_TOKEN": TOKEN}
    process = subprocess.Popen(
        [sys.executable, "-m", "pgonce", "serve", "--config", str(path), "--dsn", dsn,
         "--port", str(port)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=log.open("w"),
        text=True,
    )  # fmt: skip
    assert process.stdout is not None
    for line in process.stdout:
        if "serving on" in line:
            return Service(process, f"http://127.0.0.1:{port}", log)
    process.wait(timeout=30)
    raise AssertionError(f"the service did not start:\n{log.read_text()}")


@pytest.fixture
def service(dsn: str, tmp_path: Path) -> Iterator[Service]:
    with psycopg.connect(dsn) as conn:
        from pgonce.service.demo import SETUP

        conn.execute(SETUP)
    running = start(dsn, tmp_path)
    try:
        yield running
    finally:
        if running.process.poll() is None:
            running.stop()


def delivery(run: str, n: int, amount: int = 4200) -> tuple[bytes, dict[str, str]]:
    body = json.dumps(
        {"type": "order.created", "data": {"run": run, "order": f"o-{n}", "amount": amount}}
    ).encode()
    headers = SCHEME.sign(body, event_id=f"evt_{run}_{n}")
    return body, {**headers, "content-type": "application/json"}


async def post_all(url: str, deliveries: list[tuple[bytes, dict[str, str]]]) -> list[int]:
    async with httpx.AsyncClient(timeout=30) as client:
        gate = asyncio.Semaphore(40)

        async def post(body: bytes, headers: dict[str, str]) -> int:
            async with gate:
                return (
                    await client.post(f"{url}/webhooks/shop", content=body, headers=headers)
                ).status_code

        return list(await asyncio.gather(*(post(b, h) for b, h in deliveries)))


def effects(dsn: str, run: str) -> tuple[int, int]:
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT count(*), count(DISTINCT order_ref) FROM pgonce_demo.webhook_orders "
            "WHERE run_id = %s",
            (run,),
        ).fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


def wait_for_effects(dsn: str, run: str, expected: int, timeout: float = 60) -> tuple[int, int]:
    deadline = time.monotonic() + timeout
    found = effects(dsn, run)
    while found[1] < expected and time.monotonic() < deadline:
        time.sleep(0.05)
        found = effects(dsn, run)
    return found


def metric(url: str, name: str, **labels: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    wanted = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        if line.startswith(f"{name}{{{wanted}}}" if labels else f"{name} "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.mark.pooled
def test_storm_of_duplicates_gives_one_effect_per_event(dsn: str, service: Service) -> None:
    run = "storm"
    deliveries = [delivery(run, n) for n in range(60) for _ in range(5)]
    statuses = asyncio.run(post_all(service.url, deliveries))
    assert Counter(statuses) == {200: 300}
    assert wait_for_effects(dsn, run, 60) == (60, 60)
    assert (
        metric(service.url, "pgonce_webhook_deliveries_total", outcome="stored", source="shop")
        == 60
    )
    assert (
        metric(service.url, "pgonce_webhook_deliveries_total", outcome="duplicate", source="shop")
        == 240
    )
    # Handled: nothing pending; the inbox holds the 60 events, as PostgreSQL's estimate says.
    assert metric(service.url, "pgonce_inbox_events", source="shop", status="pending") == 0
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("ANALYZE pgonce.inbox")
    assert metric(service.url, "pgonce_table_rows", table="inbox") == 60
    assert httpx.get(f"{service.url}/readyz").json()["status"] == "ready"
    assert httpx.get(f"{service.url}/healthz").status_code == 200


def test_metrics_show_a_transaction_pinning_the_horizon(dsn: str, service: Service) -> None:
    """A session idle in a transaction on pgonce's database: /metrics shows its age, and 0 once
    it ended."""
    held = 0.5  # longer than any of the service's own transactions here
    with psycopg.connect(dsn) as holder:
        holder.execute("SELECT txid_current()")
        deadline = time.monotonic() + 30
        while (age := metric(service.url, "pgonce_oldest_transaction_seconds")) < held:
            assert time.monotonic() < deadline, f"the open transaction never showed ({age} s)"
            time.sleep(0.05)
        holder.rollback()
    # What may remain is the service's own momentary work, younger than the holder ever was.
    assert 0 <= metric(service.url, "pgonce_oldest_transaction_seconds") < held


def test_bad_deliveries_get_their_status_never_a_500(dsn: str, service: Service) -> None:
    body, headers = delivery("bad", 1)
    with httpx.Client(base_url=service.url) as client:
        assert client.post("/webhooks/shop", content=body, headers=headers).status_code == 200
        other, _ = delivery("bad", 1, amount=1)
        conflict = client.post(
            "/webhooks/shop", content=other, headers=SCHEME.sign(other, event_id="evt_bad_1")
        )
        assert conflict.status_code == 409
        assert conflict.headers["content-type"] == "application/problem+json"
        forged = {**headers, "webhook-signature": "v1,R3PTzyfHASBKHH98a7yexTwaJ4yNIcGhFQc1yuN+BPU="}
        assert client.post("/webhooks/shop", content=body, headers=forged).status_code == 401
        assert client.post("/webhooks/nope", content=body, headers=headers).status_code == 404
        assert (
            client.post("/webhooks/shop", content=b"\xff" * 10, headers=headers).status_code == 401
        )
    assert (
        metric(service.url, "pgonce_webhook_deliveries_total", outcome="conflict", source="shop")
        == 1
    )
    assert (
        metric(
            service.url,
            "pgonce_webhook_deliveries_total",
            outcome="unknown_source",
            source="unknown",
        )
        == 1
    )
    log = service.log.read_text()
    assert SECRET not in log
    assert "Traceback" not in log


def test_admin_page_needs_its_token(dsn: str, service: Service) -> None:
    body, headers = delivery("admin", 1)
    httpx.post(f"{service.url}/webhooks/shop", content=body, headers=headers)
    assert httpx.get(f"{service.url}/admin").status_code == 401
    assert httpx.get(f"{service.url}/admin", auth=("admin", "wrong")).status_code == 401
    page = httpx.get(f"{service.url}/admin/events", auth=("admin", TOKEN))
    assert page.status_code == 200
    assert "evt_admin_1" in page.text
    forged = httpx.post(
        f"{service.url}/admin/replay",
        auth=("admin", TOKEN),
        data={"source": "shop", "id": "evt_admin_1", "csrf": "guess"},
    )
    assert forged.status_code == 403


def test_sigterm_mid_burst_loses_nothing_acknowledged(
    dsn: str, service: Service, tmp_path: Path
) -> None:
    run = "sigterm"
    deliveries = [delivery(run, n) for n in range(400)]

    async def burst() -> list[int]:
        answered = 0
        some_answered = asyncio.Event()
        async with httpx.AsyncClient(timeout=30) as client:

            async def post(body: bytes, headers: dict[str, str]) -> int:
                nonlocal answered
                try:
                    r = await client.post(
                        f"{service.url}/webhooks/shop", content=body, headers=headers
                    )
                except httpx.HTTPError:
                    return 0
                answered += 1
                if answered == 50:
                    some_answered.set()
                return r.status_code

            tasks = [asyncio.create_task(post(b, h)) for b, h in deliveries]
            # SIGTERM once the service is demonstrably mid-burst: 50 answered, 350 still coming.
            await some_answered.wait()
            service.process.send_signal(signal.SIGTERM)
            return list(await asyncio.gather(*tasks))

    statuses = asyncio.run(burst())
    assert service.process.wait(timeout=60) == 0
    acknowledged = {f"evt_{run}_{n}" for n, status in enumerate(statuses) if status == 200}
    assert acknowledged, "the burst was stopped before anything was acknowledged"
    with psycopg.connect(dsn) as conn:
        stored = {
            row[0]
            for row in conn.execute(
                "SELECT event_id FROM pgonce.inbox WHERE event_id LIKE %s", (f"evt_{run}_%",)
            )
        }
    assert acknowledged <= stored
    # Restarted, the service handles whatever was stored and not yet handled, once.
    again = start(dsn, tmp_path)
    try:
        rows, distinct = wait_for_effects(dsn, run, len(stored))
    finally:
        assert again.stop() == 0
    assert rows == distinct == len(stored)


def test_serve_refuses_a_retention_shorter_than_the_retry_horizon(dsn: str, tmp_path: Path) -> None:
    path = tmp_path / "short.toml"
    path.write_text(CONFIG + 'retention = "1d"\nretry_horizon = "72h"\n')
    result = subprocess.run(
        [sys.executable, "-m", "pgonce", "serve", "--config", str(path), "--dsn", dsn],
        cwd=ROOT,
        env={**os.environ, "TEST_SHOP_SECRET": SECRET, "TEST_ADMIN_TOKEN": TOKEN},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 1
    assert "sources.shop.retention: 1d is shorter than the provider's retry horizon of 3d" in (
        result.stderr
    )
    assert "Traceback" not in result.stderr
    assert SECRET not in result.stderr


def test_send_and_events_commands(dsn: str, service: Service, tmp_path: Path) -> None:
    env = {**os.environ, "TEST_SHOP_SECRET": SECRET, "TEST_ADMIN_TOKEN": TOKEN}

    def pgonce(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "pgonce", *args],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    body = json.dumps({"data": {"run": "cli", "order": "o-1", "amount": 1}})
    sent = pgonce(
        "send", "--config", str(tmp_path / "pgonce.toml"), "--source", "shop",
        "--url", service.url, "--id", "evt_cli_1", "--body", body, "--copies", "3",
    )  # fmt: skip
    assert sent.returncode == 0, sent.stderr
    assert '2 × 200 {"outcome":"duplicate"}' in sent.stdout
    assert '1 × 200 {"outcome":"stored"}' in sent.stdout
    # Without --url: the service the configuration describes ([server] host and port).
    described = tmp_path / "described.toml"
    port = service.url.rsplit(":", 1)[1]
    described.write_text(
        CONFIG.replace("[server]\n", f'[server]\nhost = "0.0.0.0"\nport = {port}\n')
    )
    again = pgonce(
        "send", "--config", str(described), "--source", "shop", "--id", "evt_cli_1", "--body", body
    )
    assert again.returncode == 0, again.stderr
    assert '1 × 200 {"outcome":"duplicate"}' in again.stdout
    listed = pgonce("events", "--dsn", dsn, "--source", "shop", "--id", "evt_cli_1")
    assert listed.returncode == 0, listed.stderr
    assert "evt_cli_1" in listed.stdout
    shown = pgonce("events", "--dsn", dsn, "--source", "shop", "--id", "evt_cli_1", "--show")
    assert shown.returncode == 0, shown.stderr
    assert '"order": "o-1"' in shown.stdout
    assert "webhook-signature" in shown.stdout


def test_handled_events_are_counted(dsn: str, service: Service) -> None:
    run = "counted"
    asyncio.run(post_all(service.url, [delivery(run, n) for n in range(5)]))
    assert wait_for_effects(dsn, run, 5) == (5, 5)
    deadline = time.monotonic() + 10
    while metric(service.url, "pgonce_inbox_events_handled_total", outcome="done") < 5:
        assert time.monotonic() < deadline, "the handled events were never counted"
        time.sleep(0.05)


def _runs(dsn: str) -> dict[str, tuple[int, int]]:
    """Per demo run: rows the demo handler wrote and their distinct orders."""
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT run_id, count(*), count(DISTINCT order_ref) FROM pgonce_demo.webhook_orders "
            "GROUP BY run_id"
        ).fetchall()
    return {str(run): (int(n), int(d)) for run, n, d in rows}


def test_demo_fires_a_signed_storm_at_a_running_service(
    dsn: str, service: Service, tmp_path: Path
) -> None:
    before = _runs(dsn)
    result = subprocess.run(
        [sys.executable, "-m", "pgonce", "demo", "--url", service.url, "--config",
         str(tmp_path / "pgonce.toml"), "--dsn", dsn, "--orders", "20", "--copies", "4"],
        cwd=ROOT,
        env={**os.environ, "TEST_SHOP_SECRET": SECRET, "TEST_ADMIN_TOKEN": TOKEN},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "exactly once: yes" in result.stdout
    proof = {line.split()[0]: line.split() for line in result.stdout.splitlines() if line.strip()}
    assert proof["stored"][1] == "20"
    assert proof["duplicates"][1] == "60"
    # The proof checked against the database: the storm's run left one row per order.
    new = {run: counts for run, counts in _runs(dsn).items() if run not in before}
    assert list(new.values()) == [(20, 20)]


def test_a_port_in_use_is_one_clear_line(dsn: str) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "pgonce", "serve", "--dsn", dsn, "--port", str(port)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    assert result.returncode == 1
    assert f"pgonce: error: cannot listen on 127.0.0.1:{port}" in result.stderr
    assert "Traceback" not in result.stderr
    assert "never retrieved" not in result.stderr
