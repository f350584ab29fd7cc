"""Check that a running endpoint is really idempotent: a PASS / FAIL table with the evidence.

  pgonce conformance http URL        an endpoint that takes an Idempotency-Key
  pgonce conformance webhooks URL    a webhook receiver (signed deliveries, retries, refusals)

Black-box: works on any server, pgonce or not. Traffic goes only to the URL given (its server:
the paths named with --fail-path, --cookie-path, --slow-path, --safe-path; for webhooks, one
sibling path for the unknown-source check) and to --count-url if given. A run takes under a minute
(--budget). Secrets and credentials are read from the environment only (env:NAME) and never
printed. Exit status: 0 when no check failed, 1 otherwise.

Effects are counted through one number the application exposes: --count-url (a GET answering
the number) or --count-sql with --dsn (a query returning it, run read-only). Without either,
the checks that need a count are skipped, saying so.

Examples:
  pgonce conformance http http://127.0.0.1:8000/payments \\
      --body '{"amount": 1000, "currency": "EUR"}' --header 'Authorization: env:API_AUTH' \\
      --count-sql 'SELECT count(*) FROM payments' --dsn env:DATABASE_URL
  pgonce conformance webhooks http://127.0.0.1:8000/webhooks/shop \\
      --scheme standard-webhooks --secret env:SHOP_SECRET --json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

from pgonce.cli.common import add_global_options, bounded_int, http_url, printable
from pgonce.errors import ConfigError, UsageError

if TYPE_CHECKING:
    from pgonce.conformance.http import HttpTarget
    from pgonce.conformance.report import Report
    from pgonce.conformance.webhooks import WebhookTarget

NAME = "conformance"
HELP = "check that a running endpoint or webhook receiver is really idempotent"

SCHEMES = ("standard-webhooks", "stripe", "github", "shopify", "slack", "generic-hmac")


def seconds(value: str) -> float:
    """An argparse type: a positive, finite number of seconds."""
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number of seconds") from None
    if not (math.isfinite(number) and number > 0):
        raise argparse.ArgumentTypeError(f"{value} is not a positive number of seconds")
    try:
        timedelta(seconds=number)  # every duration of the kit is a timedelta somewhere
    except OverflowError:
        raise argparse.ArgumentTypeError(f"{value} seconds is out of range") from None
    return number


#: The largest body limit the 413 checks exceed: the over-limit body is built in memory.
MAX_BODY_LIMIT = 256 * 1024 * 1024
#: The most concurrent copies a race check sends (the client keeps 100 connections).
MAX_COPIES = 1000
body_limit = bounded_int(1, MAX_BODY_LIMIT)
copies = bounded_int(2, MAX_COPIES)


def configure(parser: argparse.ArgumentParser) -> None:
    kinds = parser.add_subparsers(dest="suite", metavar="KIND", required=True)
    http = kinds.add_parser(
        "http",
        help="an endpoint that takes an Idempotency-Key",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Check an endpoint that takes an Idempotency-Key. The request given "
        "(--method, --body, --header) must succeed (2xx) with a new key. Traffic goes only to "
        "URL's server (and --count-url); the run takes under --budget seconds.",
    )
    add_global_options(http)  # -v after the kind too, as after every command
    http.set_defaults(kind_parser=http)  # its usage errors show its own usage
    http.add_argument(
        "url", metavar="URL", nargs="?", help="the endpoint, such as http://host/payments"
    )
    http.add_argument("--method", default="POST", help="the endpoint's method (%(default)s)")
    body = http.add_mutually_exclusive_group()
    body.add_argument("--body", default="{}", help="the request body (default %(default)s)")
    body.add_argument("--body-file", type=Path, help="a file holding the request body")
    http.add_argument(
        "--content-type", default="application/json", help="the body's type (%(default)s)"
    )
    http.add_argument(
        "--header",
        action="append",
        default=[],
        metavar="'NAME: VALUE'",
        help="a header of every request; a VALUE env:NAME is read from the environment",
    )
    http.add_argument(
        "--other-header",
        action="append",
        default=None,
        metavar="'NAME: VALUE'",
        help="a header naming another caller (replaces --header) for the key-scope check",
    )
    http.add_argument("--other-body", help="another body the endpoint accepts (mismatch check)")
    http.add_argument(
        "--key-optional",
        action="store_true",
        help="the endpoint does not require a key (skips the key-required check)",
    )
    http.add_argument("--fail-path", help="a path on the same server answering 5xx")
    http.add_argument("--cookie-path", help="a path on the same server whose answer sets a cookie")
    http.add_argument(
        "--slow-path", help="a path on the same server that takes a second or more to answer"
    )
    http.add_argument("--safe-path", help="a path for the GET check (default: URL's path)")
    http.add_argument(
        "--max-body-bytes",
        type=body_limit,
        default=1024 * 1024,
        help="the body limit the 413 check exceeds (default %(default)s)",
    )
    http.add_argument(
        "--concurrency", type=copies, default=50, help="copies in the race check (%(default)s)"
    )
    http.add_argument(
        "--expires-header",
        default="Idempotency-Key-Expires",
        help="the key-lifetime header (%(default)s)",
    )
    http.add_argument(
        "--replay-header",
        default="Idempotent-Replayed",
        help="the header marking a replay (%(default)s)",
    )
    _common(http)

    hooks = kinds.add_parser(
        "webhooks",
        help="a webhook receiver",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Check a webhook receiver with deliveries signed like the provider's. "
        "Traffic goes only to URL, one sibling path (its last segment replaced, for the "
        "unknown-source check) and --count-url; the run takes under --budget seconds.",
    )
    add_global_options(hooks)
    hooks.set_defaults(kind_parser=hooks)
    hooks.add_argument(
        "url",
        metavar="URL",
        nargs="?",
        help="the source's endpoint, such as http://host/webhooks/shop",
    )
    hooks.add_argument("--scheme", choices=SCHEMES, help="the signature scheme (required)")
    hooks.add_argument(
        "--secret",
        metavar="env:NAME",
        help="the signing secret, read from the environment variable NAME (never printed)",
    )
    hooks.add_argument(
        "--tolerance",
        type=seconds,
        default=300,
        help="the receiver's timestamp tolerance in seconds (default %(default)s)",
    )
    hooks.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an option of the generic-hmac scheme (header=x-signature, ...)",
    )
    hooks.add_argument(
        "--max-body-bytes",
        type=body_limit,
        default=1024 * 1024,
        help="the body limit the 413 check exceeds (default %(default)s)",
    )
    hooks.add_argument(
        "--copies", type=copies, default=20, help="copies of one event in the storm (%(default)s)"
    )
    hooks.add_argument(
        "--ack-seconds",
        type=seconds,
        default=3.0,
        help="the longest acceptable acknowledgement (default %(default)s)",
    )
    _common(hooks)


def _common(parser: argparse.ArgumentParser) -> None:
    count = parser.add_argument_group("effect count")
    count.add_argument("--count-url", help="a read-only URL answering the effect count")
    count.add_argument("--count-sql", help="a query returning the effect count (needs --dsn)")
    count.add_argument(
        "--dsn",
        dest="count_dsn",
        metavar="DSN",
        help="the application's database for --count-sql; env:NAME reads it from the "
        "environment (default: $PGONCE_DSN)",
    )
    out = parser.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print the results as JSON")
    out.add_argument(
        "--only", action="append", default=[], metavar="CHECK", help="run only this check"
    )
    out.add_argument("--list", action="store_true", help="list the checks and exit")
    out.add_argument(
        "--budget",
        type=seconds,
        default=55.0,
        help="the run's time budget in seconds (default %(default)s)",
    )


def from_env(value: str, what: str) -> str:
    """``env:NAME`` read from the environment; the error never shows a value."""
    if not value.startswith("env:"):
        raise UsageError(f"{what} is read from the environment only: give env:NAME")
    name = value.removeprefix("env:")
    found = os.environ.get(name)
    if not name or not found:
        raise UsageError(f"{what}: the environment variable {name!r} is not set")
    return found


def headers_of(values: list[str], option: str) -> dict[str, str]:
    found: dict[str, str] = {}
    for item in values:
        name, sep, value = item.partition(":")
        if not sep or not name.strip():
            raise UsageError(f"{option} must be 'NAME: VALUE', such as 'Authorization: env:TOKEN'")
        value = value.strip()
        found[name.strip()] = from_env(value, option) if value.startswith("env:") else value
    return found


def options_of(values: list[str]) -> dict[str, object]:
    found: dict[str, object] = {}
    for item in values:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UsageError("--option must be KEY=VALUE")
        found[key.strip()] = value.strip()
    return found


def run(args: argparse.Namespace) -> int:
    from pgonce.conformance.http import suite as http_suite
    from pgonce.conformance.webhooks import suite as webhook_suite

    suite = http_suite if args.suite == "http" else webhook_suite
    if args.list:
        for check in suite.catalogue():
            print(f"{check.name:<28} {check.why}\n{'':<28} source: {check.source}")
        return 0
    # Usage errors (exit 2, with the usage), as argparse's own: nothing was checked.
    if not args.url:
        args.kind_parser.error("the URL to check is required (or --list)")
    if args.suite == "webhooks" and not (args.scheme and args.secret):
        args.kind_parser.error("--scheme and --secret env:NAME are required")
    try:
        # Everything the checks need is read before anything is sent.
        suite.selected(args.only)
        target = _target(args)
        count_dsn = _count_dsn(args)
    except (UsageError, ConfigError) as error:
        args.kind_parser.error(str(error))
    report = asyncio.run(_run(args, target, count_dsn))
    if args.json:
        print(json.dumps(report.as_json(), indent=2))
    else:
        # The evidence quotes what the server sent (a header's value): its control characters
        # are escaped, not handed to the terminal.
        print(printable(report.table(), keep="\n"))
    return 0 if report.passed else 1


def _target(args: argparse.Namespace) -> HttpTarget | WebhookTarget:
    """The target the options describe; a bad option is a :class:`UsageError` here."""
    from pgonce.conformance.http import HttpTarget
    from pgonce.conformance.http_run import same_origin
    from pgonce.conformance.webhooks import WebhookTarget, scheme_of

    if args.count_url and args.count_sql:
        raise UsageError("give --count-url or --count-sql, not both")
    if args.count_url:
        http_url(args.count_url)
    if args.suite == "http":
        try:
            body = args.body_file.read_bytes() if args.body_file else args.body.encode()
        except OSError as error:
            raise UsageError(f"--body-file: {error.strerror}: {args.body_file}") from None
        http_target = HttpTarget(
            url=http_url(args.url),
            body=body,
            content_type=args.content_type,
            method=args.method.upper(),
            headers=headers_of(args.header, "--header"),
            other_headers=(
                None
                if args.other_header is None
                else headers_of(args.other_header, "--other-header")
            ),
            other_body=None if args.other_body is None else args.other_body.encode(),
            key_required=not args.key_optional,
            fail_path=args.fail_path,
            cookie_path=args.cookie_path,
            safe_path=args.safe_path,
            slow_path=args.slow_path,
            max_body_bytes=args.max_body_bytes,
            concurrency=max(2, args.concurrency),
            expires_header=args.expires_header,
            replay_header=args.replay_header,
        )
        for path in (args.fail_path, args.cookie_path, args.safe_path, args.slow_path):
            if path is not None:
                same_origin(http_target.url, path)  # a bad path is refused before any request
        return http_target
    hook_target = WebhookTarget(
        url=http_url(args.url),
        scheme=args.scheme,
        secret=from_env(args.secret, "--secret"),
        tolerance=timedelta(seconds=args.tolerance),
        options=options_of(args.option),
        max_body_bytes=args.max_body_bytes,
        copies=max(2, args.copies),
        ack_seconds=args.ack_seconds,
    )
    scheme_of(hook_target)  # the scheme's options are checked before anything is sent
    return hook_target


def _count_dsn(args: argparse.Namespace) -> str | None:
    """The database --count-sql reads (None without --count-sql)."""
    if not args.count_sql:
        return None
    dsn: str | None = args.count_dsn or os.environ.get("PGONCE_DSN")
    if not dsn:
        raise UsageError("--count-sql needs --dsn (or PGONCE_DSN)")
    if dsn.startswith("env:"):
        dsn = from_env(dsn, "--dsn")
    return dsn


async def _run(
    args: argparse.Namespace, target: HttpTarget | WebhookTarget, count_dsn: str | None
) -> Report:
    from pgonce.conformance import runner
    from pgonce.conformance.effects import Effects, SqlEffects, UrlEffects
    from pgonce.conformance.http import HttpTarget, check_http
    from pgonce.conformance.webhooks import check_webhooks

    only = tuple(args.only)
    async with contextlib.AsyncExitStack() as stack:
        session = await stack.enter_async_context(runner.client())
        effects: Effects | None = None
        if args.count_url:
            effects = UrlEffects(session, args.count_url)
        elif args.count_sql:
            assert count_dsn is not None
            sql_effects = await SqlEffects.connect(count_dsn, args.count_sql)
            stack.push_async_callback(sql_effects.close)
            effects = sql_effects
        if isinstance(target, HttpTarget):
            return await check_http(
                target, effects=effects, budget=args.budget, only=only, http=session
            )
        return await check_webhooks(
            target, effects=effects, budget=args.budget, only=only, http=session
        )
