"""Bodies a sender controls, on the console's detail pages of the real ``pgonce serve``: a JSON
document nested deeper than Python's stack, and UTF-8 text whose preview cut falls inside a
character. Each page renders (never a 500), and says what the body really is."""

from __future__ import annotations

import httpx
import psycopg
from psycopg.types.json import Jsonb

from pgonce.service.console.html import BODY_PREVIEW, body_block
from tests.service.test_serve import TOKEN, Service, service  # noqa: F401 (fixture)

NESTED = b"[" * 30_000 + b"]" * 30_000  # under the preview: parsed as JSON
#: One ASCII byte, then two-byte characters: the preview's cut falls inside one of them.
ACCENTED = b"a" + "é".encode() * BODY_PREVIEW


def test_a_deep_json_body_is_shown_as_text() -> None:
    block = body_block(NESTED, "Body")
    assert "as JSON" not in block
    assert "text (UTF-8)" in block


def test_a_cut_never_makes_utf8_look_invalid() -> None:
    for character in ("é", "€", "😀"):
        for head in (b"", b"a", b"aa", b"aaa"):
            block = body_block(head + character.encode() * BODY_PREVIEW, "Body")
            assert "text (UTF-8)" in block, (character, head)
            assert "\\x" not in block
    # An invalid byte at the cut is still reported as one.
    assert "not valid UTF-8" in body_block(b"a" * (BODY_PREVIEW - 1) + b"\xff\xfe", "Body")


def test_hostile_bodies_render_on_the_real_console(dsn: str, service: Service) -> None:  # noqa: F811
    with psycopg.connect(dsn) as conn:
        for event_id, body in (("evt_nested", NESTED), ("evt_accented", ACCENTED)):
            conn.execute(
                """INSERT INTO pgonce.inbox (source, event_id, body, headers, digest, received_at,
                                             status, next_attempt_at, processed_at, attempts)
                   VALUES ('flaky', %s, %s, %s, sha256(%s), now(), 'dead', now(), now(), 1)""",
                (event_id, body, Jsonb({}), body),
            )
        conn.execute(
            """INSERT INTO pgonce.keys (scope, key, fingerprint, claimed_at, completed_at,
                                        response_status, response_headers, response_body)
               VALUES ('audit', 'nested', sha256('n'), now(), now(), 200, '[]', %s)""",
            (NESTED,),
        )
    auth = ("admin", TOKEN)
    nested = httpx.get(
        f"{service.url}/admin/event", params={"source": "flaky", "id": "evt_nested"}, auth=auth
    )
    assert nested.status_code == 200, nested.text[-500:]
    key = httpx.get(
        f"{service.url}/admin/key", params={"scope": "audit", "key": "nested"}, auth=auth
    )
    assert key.status_code == 200, key.text[-500:]
    accented = httpx.get(
        f"{service.url}/admin/event", params={"source": "flaky", "id": "evt_accented"}, auth=auth
    )
    assert accented.status_code == 200
    assert "text (UTF-8)" in accented.text
    assert "\\x" not in accented.text
