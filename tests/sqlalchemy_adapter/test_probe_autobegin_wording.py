"""The refusal of a ``Session(autobegin=False)`` outside its ``begin()`` names SQLAlchemy's
``Session`` class, the object whose setting is to change."""

from __future__ import annotations

import uuid

import pytest
from sqlalchemy import Engine
from sqlalchemy.orm import Session

from pgonce import fingerprint
from pgonce.contrib.sqlalchemy import once
from pgonce.errors import NotInTransaction

FP = fingerprint("POST", "/orders", b"{}")


def test_the_refusal_names_the_session_class(engine: Engine) -> None:
    with (
        Session(engine, autobegin=False) as session,
        pytest.raises(NotInTransaction) as raised,
        once(session, "t", uuid.uuid4().hex, FP),
    ):
        pytest.fail("the block ran")
    message = str(raised.value)
    assert "in the Session's transaction, and this Session has autobegin=False" in message
    assert "session.begin()" in message
