"""Run the inbox workers alone: claim pending events and run their handlers, exactly once each.

Workers claim events with FOR UPDATE SKIP LOCKED and run each handler in the transaction that marks
the event done, so several worker processes share the inbox without running an event twice. They
wake on LISTEN/NOTIFY and poll as a fallback. Uses the same configuration as `pgonce serve`.
SIGTERM or SIGINT lets in-flight handlers finish (or roll back) and exits 0.
"""

from __future__ import annotations

import argparse

from pgonce.cli.serve import add_service_options, run_parts

NAME = "worker"
HELP = "run only the inbox workers"


def configure(parser: argparse.ArgumentParser) -> None:
    add_service_options(parser)


def run(args: argparse.Namespace) -> int:
    return run_parts(args, ("workers",))
