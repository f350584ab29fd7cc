"""`pgonce serve` whose stdout has no reader (``pgonce serve | head -1`` once it read the
address): the service goes on. Before, the "serving on" line that could not be written stopped
it at once, with exit 1 and not a word."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent


def test_a_reader_of_stdout_that_went_away_does_not_stop_the_service(direct_dsn: str) -> None:
    read_end, write_end = os.pipe()
    os.close(read_end)
    process = subprocess.Popen(
        [sys.executable, "-m", "pgonce", "serve", "--dsn", direct_dsn, "--port", "0"],
        cwd=ROOT,
        stdout=write_end,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PGONCE__SERVER__LOG_FORMAT": "text"},
    )
    os.close(write_end)
    try:
        assert process.stderr is not None
        seen = []
        for line in process.stderr:
            seen.append(line)
            if "pgonce.service: serving on " in line:
                url = line.rsplit("serving on ", 1)[1].strip()
                break
        else:
            raise AssertionError(f"never served: {''.join(seen)}")
        with urllib.request.urlopen(f"{url}/healthz", timeout=30) as answer:
            assert answer.status == 200
        assert process.poll() is None
        process.send_signal(signal.SIGTERM)
        _, rest = process.communicate(timeout=60)
        assert process.returncode == 0, "".join(seen) + rest
        assert "Traceback" not in rest
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
