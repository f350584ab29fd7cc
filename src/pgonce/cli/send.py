"""Sign a test webhook the way a provider would, and send it to a running service.

The source's scheme and secrets come from the service's configuration (--config), so that you can
try a source without the provider. The body is --body (JSON text), --body-file, or a small sample
event; --copies sends the same delivery several times at once (a duplicate storm in miniature).

Examples:
  pgonce send --config pgonce.toml --source shop
  pgonce send --config pgonce.toml --source shop --copies 5 \\
      --body '{"data":{"order":"o-1"}}'
"""

from __future__ import annotations

import argparse
import asyncio
import json
import uuid
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, cast
from urllib.parse import urlsplit, urlunsplit

from pgonce.cli.common import bounded_int, http_url, not_empty, printable
from pgonce.core.urls import public
from pgonce.errors import ConfigError, UsageError
from pgonce.extras import needs, require
from pgonce.webhooks.schemes.base import SigningScheme

if TYPE_CHECKING:
    import httpx

NAME = "send"
#: The most copies one send fires at once: a duplicate storm in miniature, not a load test.
MAX_COPIES = 1000
HELP = "sign and send a test webhook to a running service"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--source", required=True, help="the configured source to sign for")
    parser.add_argument(
        "--url",
        help="the service (default: the configuration's [server] host and port, "
        "http://127.0.0.1:8000 without them)",
    )
    body = parser.add_mutually_exclusive_group()
    body.add_argument("--body", help="the JSON body to send (default: a small sample event)")
    body.add_argument("--body-file", type=Path, help="a file holding the body, sent as it is")
    parser.add_argument(
        "--id", dest="event_id", type=not_empty, help="the event id (default: a new one)"
    )
    parser.add_argument(
        "--copies",
        type=bounded_int(1, MAX_COPIES),
        default=1,
        help=f"send it this many times at once (default 1, at most {MAX_COPIES})",
    )


def run(args: argparse.Namespace) -> int:
    if args.url is not None:
        try:
            http_url(args.url)
        except UsageError as error:
            args.parser.error(f"--url: {error}")
    if args.body is not None:
        try:
            json.loads(args.body)
        except ValueError as error:
            # Sent as application/json: a receiver would refuse it, or store what no handler
            # reads, and the test would say nothing of the webhook it meant to try.
            args.parser.error(f"--body is not JSON ({error}); --body-file sends any bytes")
    # Said before the configuration is read, not after a delivery was signed.
    require("http", "pgonce send")
    from pgonce.service.config import load

    config = load(args.config, handlers=False)  # it signs: the handlers' code is not needed
    source = next((s.source for s in config.sources if s.source.name == args.source), None)
    if source is None and not config.sources and config.origin == "environment":
        raise ConfigError(
            f"no source {args.source!r}: no configuration file was given (--config or "
            "$PGONCE_CONFIG) and the environment configures no source"
        )
    if source is None:
        known = ", ".join(s.source.name for s in config.sources) or "none"
        raise ConfigError(f"no source {args.source!r} in {config.origin} (configured: {known})")
    if not hasattr(source.scheme, "sign"):
        raise UsageError(f"the scheme of {args.source!r} cannot sign")
    scheme = cast(SigningScheme, source.scheme)
    event_id = args.event_id or f"evt_{uuid.uuid4().hex[:16]}"
    if args.body_file:
        try:
            body = args.body_file.read_bytes()
        except OSError as error:
            raise UsageError(
                f"cannot read --body-file {args.body_file}: {error.strerror or error}"
            ) from None
    elif args.body:
        body = args.body.encode()
    else:
        sample = {"id": event_id, "type": "order.created", "data": {"order": "o-1", "amount": 4200}}
        body = json.dumps(sample, separators=(",", ":")).encode()
    headers = {**scheme.sign(body, event_id=event_id), "content-type": "application/json"}
    url = args.url or service_url(config.host, config.port)
    statuses = asyncio.run(_send(webhook_url(url, args.source), body, headers, args.copies))
    for (status, text), count in sorted(statuses.items()):
        # What the server answered, on one line: its control characters (a newline of an HTML
        # page, an escape sequence) are escaped, not handed to the terminal.
        print(f"{count} × {status} {printable(text)}")
    return 0 if all(status == 200 for status, _ in statuses) else 1


#: How long one delivery may take, in seconds.
SEND_TIMEOUT = 30


def webhook_url(url: str, source: str) -> str:
    """The source's endpoint on the service at ``url``: its path joined to the URL's path, the
    URL's query (a proxy's ?token=) kept after it, where it used to swallow the path."""
    parts = urlsplit(url)
    path = f"{parts.path.rstrip('/')}/webhooks/{source}"
    return urlunsplit(parts._replace(path=path, fragment=""))


def service_url(host: str, port: int) -> str:
    """The URL the configured service answers on; a wildcard address is reached on loopback."""
    if host in ("", "0.0.0.0"):  # noqa: S104 (a wildcard to connect to, not to bind)
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


async def _send(
    url: str, body: bytes, headers: dict[str, str], copies: int
) -> Counter[tuple[int, str]]:
    with needs("http", "pgonce send"):
        import httpx

    async with httpx.AsyncClient(timeout=SEND_TIMEOUT) as client:
        try:
            answers = await asyncio.gather(
                *(client.post(url, content=body, headers=headers) for _ in range(copies))
            )
        except (httpx.RemoteProtocolError, httpx.ReadError) as error:
            # Reached: the server (or a proxy) broke its answer off, or spoke no HTTP.
            raise UsageError(f"{public(url)} gave no complete answer: {_reason(error)}") from None
        except httpx.HTTPError as error:
            raise UsageError(f"cannot reach {public(url)}: {_reason(error)}") from None
    return Counter((r.status_code, _said(r)) for r in answers)


def _said(response: httpx.Response) -> str:
    """What an answer said: the start of its body, or where a redirect points (it is not
    followed: the service's own answer is what a test delivery tries)."""
    location = response.headers.get("location")
    if response.is_redirect and location is not None:
        return f"a redirect to {public(location)} (not followed)"
    return response.text.strip()[:200]


def _reason(error: Exception) -> str:
    """Why a delivery got no answer: the HTTP client's timeouts carry no message, nor does a
    connection the server closed unanswered (a TLS handshake on a port that does not serve TLS)."""
    import httpx

    if said := str(error):
        return said
    if isinstance(error, httpx.TimeoutException):
        said = f"no answer within {SEND_TIMEOUT} s"
    elif isinstance(error, httpx.ConnectError) and url_scheme(error) == "https":
        said = (
            "the server closed the connection during the TLS handshake: does it serve TLS on "
            "that port? (http:// if not)"
        )
    else:
        said = "the server closed the connection without answering"
    return f"{type(error).__name__}: {said}"


def url_scheme(error: Exception) -> str:
    """The scheme of the URL the failed request was for ("" when the error has no request)."""
    try:
        return str(error.request.url.scheme)  # type: ignore[attr-defined]
    except (AttributeError, RuntimeError):
        return ""
