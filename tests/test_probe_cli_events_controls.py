"""``pgonce events`` prints what senders wrote (event ids, bodies, handler errors) without the
control characters in it: an ESC sequence in a stored body reached the operator's terminal as is,
where it can clear the screen, retitle the window or hide the lines around it. They are shown as
``\\u001b`` escapes (the same value to a JSON reader); newlines and tabs of a body are kept."""

from __future__ import annotations

import hashlib

import psycopg
from psycopg.types.json import Jsonb

from tests.test_cli import pgonce

ESC_ID = "evt_\x1b]0;owned\x07"
BODY = '{"name": "\x1b[2J\x1b[31mred\x9b"}\n\t{"next": 1}'


def store_event(dsn: str) -> None:
    body = BODY.encode()
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO pgonce.inbox (source, event_id, body, headers, digest, received_at,"
            " status, attempts, next_attempt_at, last_error, processed_at)"
            " VALUES ('shop', %s, %s, %s, %s, now(), 'dead', 3, now(), %s, now())",
            (
                ESC_ID,
                body,
                Jsonb({"x-note": "a\x1b[8mhidden"}),
                hashlib.sha256(body).digest(),
                "KeyError: '\x1b[2K'",
            ),
        )


def test_the_list_shows_control_characters_as_escapes(dsn: str) -> None:
    store_event(dsn)
    result = pgonce("events", "--dsn", dsn)
    assert result.returncode == 0, result.stderr
    assert "\x1b" not in result.stdout
    assert "\x07" not in result.stdout
    assert "evt_\\u001b]0;owned\\u0007" in result.stdout
    assert "KeyError: '\\u001b[2K'" in result.stdout


def test_show_prints_the_body_with_escapes_and_keeps_its_lines(dsn: str) -> None:
    store_event(dsn)
    result = pgonce("events", "--dsn", dsn, "--source", "shop", "--id", ESC_ID, "--show")
    assert result.returncode == 0, result.stderr
    for control in ("\x1b", "\x07", "\x9b"):
        assert control not in result.stdout
    assert '{"name": "\\u001b[2J\\u001b[31mred\\u009b"}\n\t{"next": 1}' in result.stdout
    assert "x-note: a\\u001b[8mhidden" in result.stdout


def test_doctor_shows_the_newest_error_with_escapes(dsn: str) -> None:
    store_event(dsn)
    result = pgonce("doctor", "--dsn", dsn)
    assert "Traceback" not in result.stderr
    assert "\x1b" not in result.stdout
    assert "last error: KeyError: '\\u001b[2K'" in result.stdout, result.stdout


def test_replay_prints_the_replayed_id_with_escapes(dsn: str) -> None:
    store_event(dsn)
    result = pgonce("replay", "--dsn", dsn, "--source", "shop")
    assert result.returncode == 0, result.stderr
    assert result.stdout == "evt_\\u001b]0;owned\\u0007\n"
