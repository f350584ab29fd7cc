"""Commands that cannot do anything say so, and no command falls back to the embedded database
silently: each case runs the real command line and asserts the useful part of its message."""

from __future__ import annotations

import subprocess
from datetime import UTC, datetime
from pathlib import Path

import psycopg
import pytest

from pgonce.errors import UsageError
from pgonce.service.demo import service_url
from pgonce.store._sync.outbox import enqueue
from tests.test_cli import pgonce as run_pgonce

ROOT = Path(__file__).resolve().parents[2]
SECRET = "whsec_C2FVsBQIhrscChlQIMV+b5sSYspob7oD"
SHOP = """
[sources.shop]
scheme = "standard-webhooks"
secrets = ["env:TEST_SHOP_SECRET"]
handler = "pgonce.service.demo:record_order"
"""


def pgonce(
    *args: str, env: dict[str, str] | None = None, cwd: Path = ROOT
) -> subprocess.CompletedProcess[str]:
    """The command line without this process's PGONCE_* settings: each test gives its own."""
    env = {"TEST_SHOP_SECRET": SECRET, **(env or {})}
    return run_pgonce(*args, env=env, cwd=cwd, own_settings=True)


def one_error(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode != 0, result.stdout
    assert "Traceback" not in result.stderr, result.stderr
    # The error is the last thing said; a configuration's problems follow it, one a line.
    error = result.stderr[result.stderr.rindex("pgonce: error: ") :]
    return " ".join(error.split())


@pytest.mark.parametrize("verbose", [("-v", "relay"), ("relay", "-v"), ("relay",)])
def test_a_relay_with_no_outbox_exits_naming_the_section(verbose: tuple[str, ...]) -> None:
    message = one_error(pgonce(*verbose))
    assert "pgonce relay has nothing to publish" in message
    assert "no [outbox] section; add one naming the broker" in message


def test_a_worker_with_no_handler_exits_naming_the_section() -> None:
    assert "pgonce worker has no handler to run" in one_error(pgonce("worker", "-v"))


def test_global_options_go_before_or_after_the_command(dsn: str, tmp_path: Path) -> None:
    config = tmp_path / "pgonce.toml"
    config.write_text('[database]\ndsn = "env:TEST_DSN"\n')
    for args in (
        ("--config", str(config), "migrate", "--status"),
        ("migrate", "--status", "--config", str(config), "-v"),
        ("-v", "--dsn", dsn, "migrate", "--status"),
    ):
        result = pgonce(*args, env={"TEST_DSN": dsn})
        assert result.returncode == 0, (args, result.stderr)
        assert "version" in result.stdout
    assert "does not take --dsn" in pgonce("--dsn", dsn, "send", "--source", "x").stderr


def test_help_texts_are_true_for_an_installed_package() -> None:
    serve = pgonce("serve", "--help").stdout
    assert "examples/" not in serve
    assert "[outbox]" in serve
    assert "require_dsn = true" in serve
    sweep = pgonce("sweep", "--help").stdout
    assert "once they exist" not in sweep
    assert "published outbox rows" in sweep
    migrate = " ".join(pgonce("migrate", "--help").stdout.split())
    assert "with --status, 1 when migrations are pending" in migrate
    assert "examples/" not in pgonce("send", "--help").stdout


def test_a_required_dsn_that_is_missing_is_an_error_never_the_embedded_server(
    tmp_path: Path,
) -> None:
    want = "no database is configured and a DSN is required"
    assert want in one_error(pgonce("migrate", env={"PGONCE_REQUIRE_DSN": "1"}, cwd=tmp_path))
    assert want in one_error(pgonce("doctor", "--require-dsn", cwd=tmp_path))
    config = tmp_path / "pgonce.toml"
    config.write_text("[database]\nrequire_dsn = true\n")
    assert want in one_error(pgonce("--config", str(config), "migrate", cwd=tmp_path))
    assert not (tmp_path / ".pgonce").exists()


def test_a_dsn_variable_that_is_unset_is_an_error_never_a_fallback(tmp_path: Path) -> None:
    config = tmp_path / "pgonce.toml"
    config.write_text('[database]\ndsn = "env:DATABSE_URL"\n')
    message = one_error(pgonce("migrate", "--config", str(config), cwd=tmp_path))
    assert "database.dsn: the environment variable DATABSE_URL is not set" in message
    empty = one_error(pgonce("migrate", env={"PGONCE_DSN": ""}, cwd=tmp_path))
    assert "PGONCE_DSN is set but empty" in empty
    assert not (tmp_path / ".pgonce").exists()


def test_the_embedded_server_is_announced_on_the_first_line(tmp_path: Path) -> None:
    # A data folder that cannot be made: the notice still comes first, before the start fails.
    blocker = tmp_path / "file"
    blocker.write_text("")
    result = pgonce("migrate", "--data-dir", str(blocker / "data"), cwd=tmp_path)
    first = result.stderr.splitlines()[0]
    assert first.startswith(f"pgonce: using an embedded PostgreSQL with its data in {blocker}")
    assert "not for production data; set PGONCE_DSN" in first


def test_demo_url_is_the_service_or_the_sources_endpoint() -> None:
    assert service_url("http://h:8000/webhooks/shop/", "shop") == "http://h:8000"
    assert service_url("http://h:8000", "shop") == "http://h:8000"
    assert service_url("https://h/base/webhooks/shop", "shop") == "https://h/base"
    with pytest.raises(UsageError, match="names the endpoint of source 'billing'"):
        service_url("http://h/webhooks/billing", "shop")
    with pytest.raises(UsageError, match="must be the service's http"):
        service_url("h:8000", "shop")


def test_demo_against_a_service_without_its_table_says_how_to_fix_it(
    dsn: str, tmp_path: Path
) -> None:
    config = tmp_path / "pgonce.toml"
    config.write_text(SHOP)
    # Nothing listens on port 1: the check comes before any delivery is sent.
    args = ("demo", "--url", "http://127.0.0.1:1/webhooks/shop", "--config", str(config))
    message = one_error(pgonce(*args, "--dsn", dsn))
    assert "the demo's table pgonce_demo.webhook_orders does not exist in PostgreSQL at" in message
    assert "start the service with `pgonce serve --demo`" in message


def test_doctor_reports_refused_and_failed_rows_with_their_last_error(dsn: str) -> None:
    with psycopg.connect(dsn) as conn:
        parked = enqueue(conn, "invoice", "1", "created", {})
        waiting = enqueue(conn, "order", "7", "created", {})
        conn.execute(
            "UPDATE pgonce.outbox SET attempts = 12, parked_at = now(), last_error = %s"
            " WHERE id = %s",
            ("RabbitMQ returned the message as unroutable", parked),
        )
        conn.execute(
            "UPDATE pgonce.outbox SET attempts = 1, next_attempt_at = %s, last_error = %s"
            " WHERE id = %s",
            (datetime(2030, 1, 1, tzinfo=UTC), "JetStream refused the message", waiting),
        )
        conn.execute(
            "INSERT INTO pgonce.inbox (source, event_id, body, headers, digest, status, attempts,"
            " last_error, processed_at, received_at, next_attempt_at) VALUES ('shop', 'evt_1',"
            " '{}', '{}', sha256('x'::bytea), 'dead', 10, 'LookupError: no customer', now(),"
            " now(), now())"
        )
    result = pgonce("doctor", "--dsn", dsn)
    out = result.stdout
    assert "outbox aggregate type 'invoice': 1 parked (waiting for `pgonce replay --outbox" in out
    assert "last error: RabbitMQ returned the message as unroutable" in out
    assert "outbox aggregate type 'order': 1 waiting (next attempt 2030-01-01 00:00:00" in out
    assert "inbox source 'shop': 1 dead (waiting for `pgonce replay --source shop`" in out
    assert "last error: LookupError: no customer" in out
    assert result.returncode == 0
    assert pgonce("doctor", "--dsn", dsn, "--strict").returncode == 1


def test_doctor_reads_the_failed_rows_from_the_partial_indexes_only(dsn: str) -> None:
    from pgonce import sql as pgsql
    from tests.test_indexes import RETAINED, _plan_nodes

    with psycopg.connect(dsn) as conn:
        for table in ("inbox", "outbox"):
            conn.execute(RETAINED[table].encode())
            conn.execute(f"ANALYZE pgonce.{table}".encode())
        nodes = list(_plan_nodes(conn, pgsql.Queries("inspect", "pgonce").troubles, {}))
    indexes = {node["Index Name"] for node in nodes if "Index Name" in node}
    assert indexes == {"outbox_pending", "outbox_parked", "inbox_pending", "inbox_dead"}
    scans = [node["Node Type"] for node in nodes if "Relation Name" in node]
    assert "Seq Scan" not in scans, scans
