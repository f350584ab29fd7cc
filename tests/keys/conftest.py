"""The key store's async tests run on both event loops a caller may use: asyncio's own and uvloop
(uvicorn's pick, and so the HTTP middleware's). The async batches talk to the loop directly
(store/wire.py), and the two differ where it matters: uvloop closes a registration whose socket
reports an error."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping

import pytest
import uvloop


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> Mapping[str, Callable[[], asyncio.AbstractEventLoop]]:
    return {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}
