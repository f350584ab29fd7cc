"""Relays as separate processes (tests/outbox/relay_process.py): start, release, read output."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


async def start_relay(
    dsn: str, broker: str, url: str, dest: str, *extra: str
) -> asyncio.subprocess.Process:
    """A relay process; returns once it printed "ready" (connected, about to claim)."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tests.outbox.relay_process",
        dsn,
        broker,
        url,
        dest,
        *extra,
        cwd=ROOT,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )
    assert process.stdout is not None
    line = await asyncio.wait_for(process.stdout.readline(), timeout=30)
    assert line.strip() == b"ready", line
    return process


async def read_line(process: asyncio.subprocess.Process, within: float = 60) -> bytes:
    assert process.stdout is not None
    line = await asyncio.wait_for(process.stdout.readline(), timeout=within)
    assert line, f"relay process {process.pid} ended without output (exit {process.returncode})"
    return line


async def go(process: asyncio.subprocess.Process) -> None:
    """Release a relay started with ``--wait-go``."""
    assert process.stdin is not None
    process.stdin.write(b"go\n")
    await process.stdin.drain()
