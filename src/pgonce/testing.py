"""A fake payment provider for testing two-phase requests: real HTTP, its own Idempotency-Key.

:class:`FakeProvider` is a small HTTP server (the standard library's, in a thread) that behaves
as payment providers do: ``POST /v1/charges`` with an ``Idempotency-Key`` header creates a charge
once, and the same key again answers the first charge, byte for byte, with
``Idempotent-Replayed: true``; the same key with another request is refused (409). It counts the
charges it made, so a test can prove a payment was charged exactly once whatever crashed in
between. :func:`charge` is its client (``urllib``: no dependency).

::

    with FakeProvider() as provider:
        made = charge(provider.url, "pgonce-...", payment="p1", amount=42)
        assert provider.charges_for("p1") == 1

Use it in tests and examples only: it keeps everything in memory.
"""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any

#: What a charge request carries: the payment it is for and the amount.
ChargeRequest = dict[str, Any]


class FakeProvider:
    """A payment provider on ``127.0.0.1`` with Idempotency-Key support; see the module.

    ``after_charge(request)`` runs on the server's thread after a new charge was made and before
    it is answered: a crash test kills the caller there, in the middle of the provider call.
    """

    def __init__(self, *, after_charge: Callable[[ChargeRequest], None] | None = None) -> None:
        self.after_charge = after_charge
        self._lock = threading.Lock()
        self._answers: dict[str, tuple[bytes, bytes]] = {}  # key -> (request body, answer)
        self._made: Counter[str] = Counter()
        self.requests = 0
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    @property
    def charges(self) -> int:
        """Charges made (a replayed key makes none)."""
        with self._lock:
            return sum(self._made.values())

    def charges_for(self, payment: str) -> int:
        with self._lock:
            return self._made[payment]

    def charged(self) -> dict[str, int]:
        """Charges made, by payment."""
        with self._lock:
            return dict(self._made)

    def __enter__(self) -> FakeProvider:
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _answer(self, key: str, body: bytes) -> tuple[int, bytes, bool]:
        """(status, answer, replayed) for a charge request under ``key``."""
        request: ChargeRequest = json.loads(body)
        with self._lock:
            self.requests += 1
            if key in self._answers:
                first, answer = self._answers[key]
                if first != body:
                    return 409, b'{"error":"idempotency key reused with another request"}', False
                return 200, answer, True
            self._made[str(request["payment"])] += 1
            number = sum(self._made.values())
            answer = json.dumps(
                {"id": f"ch_{number}", "payment": request["payment"], "amount": request["amount"]},
                separators=(",", ":"),
            ).encode()
            self._answers[key] = (body, answer)
        if self.after_charge is not None:
            self.after_charge(request)
        return 200, answer, False

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        provider = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                key = self.headers.get("idempotency-key")
                if self.path != "/v1/charges" or not key:
                    status, answer, replayed = 400, b'{"error":"Idempotency-Key required"}', False
                else:
                    status, answer, replayed = provider._answer(key, body)
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(answer)))
                if replayed:
                    self.send_header("idempotent-replayed", "true")
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, format: str, *args: Any) -> None:
                pass  # quiet: tests read the counts, not the log

        return Handler


class ProviderError(Exception):
    """The fake provider refused a charge."""


def charge(
    url: str, idempotency_key: str, *, payment: str, amount: int, timeout: float = 10
) -> dict[str, Any]:
    """Charge ``amount`` for ``payment`` at the provider under ``idempotency_key``; the charge."""
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"the provider's URL must be http(s), not {url!r}")
    request = urllib.request.Request(  # noqa: S310 (the scheme is checked above)
        f"{url}/v1/charges",
        data=json.dumps({"payment": payment, "amount": amount}, separators=(",", ":")).encode(),
        headers={"content-type": "application/json", "idempotency-key": idempotency_key},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:  # noqa: S310
            made: dict[str, Any] = json.loads(answer.read())
    except urllib.error.HTTPError as error:
        raise ProviderError(f"the provider answered {error.code}: {error.read()!r}") from None
    return made
