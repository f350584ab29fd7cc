"""Operator commands on a real database: sweep honours the configuration's retention and refuses
a future --now, a DSN that cannot be parsed is refused unshown, operator commands never create a
schema, and bad input is one line with the right exit code."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import psycopg

from tests.test_cli import pgonce


def old_key(dsn: str, days: int) -> None:
    with psycopg.connect(dsn) as conn:
        conn.execute(
            """INSERT INTO pgonce.keys (scope, key, fingerprint, claimed_at, completed_at,
                                        response_status, response_headers, response_body)
               VALUES ('api', 'old', sha256('old'), now() - make_interval(days => %(d)s),
                       now() - make_interval(days => %(d)s), 200, '[]', '')""",
            {"d": days},
        )


def keys(dsn: str) -> int:
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT count(*) FROM pgonce.keys").fetchone()
    assert row is not None
    return int(row[0])


def test_sweep_keeps_keys_for_the_configured_retention(dsn: str, tmp_path: Path) -> None:
    old_key(dsn, 40)
    config = tmp_path / "pgonce.toml"
    config.write_text('[keys]\nretention = "90d"\n')
    result = pgonce("sweep", "--config", str(config), "--dsn", dsn, own_settings=True)
    assert result.returncode == 0, result.stderr
    assert keys(dsn) == 1
    flag = pgonce("sweep", "--config", str(config), "--dsn", dsn, "--retention", "30d")
    assert flag.returncode == 0, flag.stderr
    assert keys(dsn) == 0


def test_migrate_and_sweep_need_no_secret_of_the_service(dsn: str, tmp_path: Path) -> None:
    old_key(dsn, 40)
    config = tmp_path / "pgonce.toml"
    config.write_text(
        '[keys]\nretention = "90d"\n[admin]\ntoken = "env:ADMIN_TOKEN"\n'
        '[outbox]\npublisher = "rabbitmq"\nurl = "env:BROKER_URL"\n'
        '[sources.shop]\nscheme = "standard-webhooks"\nsecrets = ["env:SHOP_SECRET"]\n'
        'handler = "pgonce.service.demo:record_order"\n'
    )
    for args in (("migrate",), ("sweep",), ("doctor",), ("events",)):
        result = pgonce(*args, "--config", str(config), "--dsn", dsn, own_settings=True)
        assert result.returncode == 0, (args, result.stderr)
    assert keys(dsn) == 1  # the file's retention of keys held
    served = pgonce("serve", "--config", str(config), "--dsn", dsn, own_settings=True)
    assert served.returncode == 1
    assert "SHOP_SECRET is not set" in served.stderr


def test_sweep_refuses_a_future_now_unless_it_is_a_dry_run(dsn: str) -> None:
    old_key(dsn, 1)
    later = (datetime.now(UTC) + timedelta(days=60)).isoformat()
    refused = pgonce("sweep", "--dsn", dsn, "--now", later, own_settings=True)
    assert refused.returncode == 1
    assert "later than the database's clock" in refused.stderr
    assert "Traceback" not in refused.stderr
    dry = pgonce("sweep", "--dsn", dsn, "--now", later, "--dry-run", own_settings=True)
    assert dry.returncode == 0, dry.stderr
    assert "1 rows would be deleted" in dry.stdout
    assert "nothing was deleted" in dry.stdout
    assert keys(dsn) == 1


def test_an_unparsable_dsn_is_refused_without_its_password() -> None:
    result = pgonce("doctor", "--dsn", "postgresql://postgres:s3cretpw@[::1:5999/x")
    assert result.returncode == 1
    assert result.stderr.startswith("pgonce: error: the connection string cannot be parsed")
    assert "s3cretpw" not in result.stderr + result.stdout
    # A password with an unescaped @ is not read as part of the host in messages either.
    result = pgonce("migrate", "--dsn", "postgresql://nobody:s3c@retpw@127.0.0.1:1/db")
    assert result.returncode == 1
    assert "retpw" not in result.stderr
    assert "unescaped @" in result.stderr


def test_operator_commands_refuse_an_unmigrated_schema(dsn: str, tmp_path: Path) -> None:
    config = tmp_path / "pgonce.toml"
    config.write_text(
        '[outbox]\npublisher = "nats"\n[sources.shop]\nscheme = "standard-webhooks"\n'
        'secrets = ["env:SHOP_SECRET"]\nhandler = "pgonce.service.demo:record_order"\n'
    )
    env = {"SHOP_SECRET": "whsec_C2FVsBQIhrscChlQIMV+b5sSYspob7oD"}
    for args in (("replay", "--source", "shop"), ("relay",), ("worker",)):
        result = pgonce(*args, "--config", str(config), "--dsn", dsn, "--schema", "pgnoce", env=env)
        assert result.returncode == 1, (args, result.stderr)
        assert "run `pgonce migrate`" in result.stderr, result.stderr
    with psycopg.connect(dsn) as conn:
        found = conn.execute("SELECT 1 FROM pg_namespace WHERE nspname = 'pgnoce'").fetchone()
    assert found is None


def test_bad_input_is_one_line_with_its_exit_code(tmp_path: Path) -> None:
    port = pgonce("serve", "--port", "99999")
    assert port.returncode == 2
    assert "is not a port" in port.stderr
    limit = pgonce("events", "--limit", "0")
    assert limit.returncode == 2
    assert "positive whole number" in limit.stderr
    config = tmp_path / "pgonce.toml"
    config.write_text(
        '[sources.shop]\nscheme = "standard-webhooks"\nsecrets = ["env:SHOP_SECRET"]\n'
    )
    env = {"SHOP_SECRET": "whsec_C2FVsBQIhrscChlQIMV+b5sSYspob7oD"}
    missing = str(tmp_path / "missing.json")
    send = pgonce(
        "send", "--config", str(config), "--source", "shop", "--body-file", missing, env=env
    )
    assert send.returncode == 1
    assert send.stderr.strip().splitlines() == [
        f"pgonce: error: cannot read --body-file {missing}: No such file or directory"
    ]
