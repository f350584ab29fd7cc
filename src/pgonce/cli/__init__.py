"""The ``pgonce`` command line.

Every command has ``--help``. Errors are one line on stderr and a non-zero exit code, never a
traceback: pgonce's own errors print their message and exit 1; anything else is a bug and says so
in one line (exit 1), with its traceback under ``-v``. Output into a pipe whose reader is gone
(``pgonce events | head -1``) stops quietly with exit 1. A usage error (an unknown option, a bad
value for one) is argparse's and exits 2. SIGINT or SIGTERM stops a command the way Ctrl-C does,
closing what it opened (its connections, the embedded PostgreSQL it started): exit 130 or 143,
except for the services (serve, worker, relay), which stop with exit 0 as their help says.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import select
import signal
import sys
import traceback
from collections.abc import Sequence

from pgonce._version import __version__
from pgonce.cli import (
    conformance,
    demo,
    doctor,
    events,
    migrate,
    relay,
    replay,
    send,
    serve,
    sweep,
    worker,
)
from pgonce.cli.common import (
    DATABASE_OPTIONS,
    Command,
    Terminated,
    add_database_options,
    add_global_options,
    fill_defaults,
    stop_on_sigterm,
)
from pgonce.errors import PgonceError
from pgonce.store.errors import first_line

#: The commands, in the order ``--help`` lists them. A command module has NAME, HELP,
#: ``configure(parser)`` and ``run(args) -> int``.
COMMANDS: tuple[Command, ...] = (
    serve,
    worker,
    relay,
    migrate,
    demo,
    sweep,
    doctor,
    events,
    send,
    replay,
    conformance,
)

EPILOG = """\
With no --dsn and no PGONCE_DSN, pgonce starts an embedded PostgreSQL 18 with its data in
.pgonce/data (PGONCE_DATA_DIR), so nothing else needs to be installed.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pgonce",
        description="Exactly-once API calls, webhooks and event publishing on PostgreSQL.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"pgonce {__version__}")
    add_global_options(parser)
    add_database_options(parser)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for command in COMMANDS:
        child = sub.add_parser(
            command.NAME,
            help=command.HELP,
            description=command.__doc__,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        add_global_options(child)
        command.configure(child)
        takes = {action.dest for action in child._actions}
        # parser: a command's run() refuses options that do not go together with
        # args.parser.error(), a usage error (exit 2) as argparse's own.
        child.set_defaults(run=command.run, takes=takes, parser=child)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    # A database option before a command that has no database (send) is refused, not ignored.
    for name in DATABASE_OPTIONS:
        if hasattr(args, name) and name not in args.takes:
            parser.error(f"pgonce {args.command} does not take --{name.replace('_', '-')}")
    fill_defaults(args)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    stop_on_sigterm()
    try:
        code: int = args.run(args)
    except PgonceError as error:
        print(f"pgonce: error: {error}", file=sys.stderr)
        return 1
    except Terminated:
        print("pgonce: terminated", file=sys.stderr)
        return 128 + signal.SIGTERM
    except KeyboardInterrupt:
        print("pgonce: interrupted", file=sys.stderr)
        return 130
    except Exception as error:  # a bug: one line to report, the traceback only when asked
        # Unless it is stdout's reader that went away; a broker's broken pipe is reported.
        if isinstance(error, BrokenPipeError) and stdout_reader_gone():
            return reader_gone()
        if args.verbose:
            traceback.print_exc()
        print(
            f"pgonce: internal error: {type(error).__name__}: {first_line(error)}; please report "
            "it (-v shows the traceback)",
            file=sys.stderr,
        )
        return 1
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        return reader_gone()
    return code


def stdout_reader_gone() -> bool:
    """Whether stdout is a pipe whose reading end is closed (it polls as an error)."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (OSError, ValueError, AttributeError):
        return False


def reader_gone() -> int:
    """The reader of stdout went away (``pgonce events | head -1``): nothing to say, exit 1.

    What is still buffered cannot be written; stdout is pointed at /dev/null so that the
    interpreter's own flush at exit does not report it again.
    """
    with contextlib.suppress(OSError, ValueError):
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 1
