"""A service URL given on the command line (send --url, demo --url) is shown without its password,
and a service that cannot be reached is a one-line error, not an internal one."""

from __future__ import annotations

import subprocess
from pathlib import Path

import psycopg

from pgonce.service.demo import SETUP
from tests.test_cli import pgonce

SECRET = "whsec_C2FVsBQIhrscChlQIMV+b5sSYspob7oD"
CONFIG = """
[sources.shop]
scheme = "standard-webhooks"
secrets = ["env:TEST_SHOP_SECRET"]
handler = "pgonce.service.demo:record_order"
"""
UNREACHABLE = "http://ops:hunter2@127.0.0.1:1/"


def run(tmp_path: Path, *args: str, dsn: str | None = None) -> subprocess.CompletedProcess[str]:
    config = tmp_path / "pgonce.toml"
    config.write_text(CONFIG)
    env = {"TEST_SHOP_SECRET": SECRET, **({"PGONCE_DSN": dsn} if dsn else {})}
    return pgonce("--config", str(config), *args, env=env, own_settings=True)


def assert_unreachable_said_once(result: subprocess.CompletedProcess[str]) -> None:
    assert result.returncode == 1, result.stderr
    assert "hunter2" not in result.stderr + result.stdout
    assert "Traceback" not in result.stderr
    assert "internal error" not in result.stderr, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("pgonce: error: cannot reach http://ops:***@127.0.0.1:1"), last


def test_send_to_an_unreachable_url_hides_its_password(tmp_path: Path) -> None:
    assert_unreachable_said_once(run(tmp_path, "send", "--source", "shop", "--url", UNREACHABLE))


def test_demo_at_an_unreachable_url_is_one_line_without_its_password(
    tmp_path: Path, dsn: str
) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(SETUP)
    result = run(tmp_path, "demo", "--url", UNREACHABLE, "--orders", "1", "--copies", "1", dsn=dsn)
    assert_unreachable_said_once(result)
