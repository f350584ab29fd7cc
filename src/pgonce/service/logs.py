"""Logs of the service: JSON lines for machines, readable text on a terminal.

Fields a record carries with ``extra=`` (``source``, ``event_id``, ``outcome``, ``duration_ms``,
...) become JSON fields. Nothing here adds a payload or a secret; code that logs must not either.
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime
from typing import Any

#: Attributes every LogRecord has; anything else on a record came from ``extra=``.
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message",
    "asctime",
    "color_message",  # uvicorn's copy of the message with terminal colours
}


class JsonLines(logging.Formatter):
    """One JSON object per line: ts, level, logger, message and the record's extra fields."""

    def format(self, record: logging.LogRecord) -> str:
        document: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for name, value in vars(record).items():
            if name not in _STANDARD and not name.startswith("_"):
                document[name] = value
        if record.exc_info and record.exc_info[0] is not None:
            # The type and message only: a traceback in a log line is for developers' terminals.
            document["error"] = f"{record.exc_info[0].__name__}: {record.exc_info[1]}"
        return json.dumps(document, default=str)


def configure(fmt: str = "auto", level: int = logging.INFO) -> None:
    """Route pgonce's and uvicorn's logs to stderr in ``fmt`` ("auto", "json" or "text")."""
    if fmt == "auto":
        fmt = "text" if sys.stderr.isatty() else "json"
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        JsonLines()
        if fmt == "json"
        else logging.Formatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s")
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).handlers[:] = []
        logging.getLogger(name).propagate = True
    # One access line per webhook delivery is the receiver's job (with its outcome); uvicorn's
    # access log would double it, and httpx's request lines (forwards, the demo) are noise.
    logging.getLogger("uvicorn.access").setLevel(logging.WARNING)
    logging.getLogger("httpx").setLevel(logging.WARNING)
