"""A background part of the service that dies stops the whole service at once, with an error."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import pytest

from pgonce.config import Settings
from pgonce.errors import ServiceFailed
from pgonce.service import runner
from pgonce.service.config import ServiceConfig


async def test_a_dying_sweeper_stops_the_service_with_an_error(dsn: str) -> None:
    # An interval the loader refuses, set past it: the sweeper's loop raises at its first turn.
    config = replace(ServiceConfig(settings=Settings(dsn=dsn)), sweep_every=timedelta(0))
    with pytest.raises(ServiceFailed, match="the sweeper stopped the service"):
        await asyncio.wait_for(runner.run(config, dsn, parts=("sweeper",)), timeout=30)


def test_a_replay_form_mixing_a_source_and_events_is_refused(dsn: str, tmp_path: Path) -> None:
    import httpx

    from pgonce.service.admin import AdminAuth
    from tests.service.test_serve import TOKEN, start

    service = start(dsn, tmp_path)
    try:
        form = {
            "csrf": AdminAuth(TOKEN).csrf,
            "all_of": "shop",
            "event": '["shop", "evt_1"]',
            "confirm": "yes",
        }
        answer = httpx.post(f"{service.url}/admin/replay", data=form, auth=("admin", TOKEN))
        assert answer.status_code == 400
        assert "Choose one kind of replay" in answer.text
    finally:
        service.stop()
