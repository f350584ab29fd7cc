"""Run the outbox relay alone: publish committed outbox rows to the configured broker.

A row is marked published only after the broker acknowledged it, in the transaction that claimed
it (FOR UPDATE SKIP LOCKED), so several relay processes share the outbox without double publishing
and a relay killed mid-batch leads to a redelivery with the same message id, never a loss. Uses the
same configuration as `pgonce serve` ([outbox] publisher, url, ...).
SIGTERM or SIGINT lets a batch at the broker mark what the broker acknowledged (for 10 s at
most), cancels a statement that waits on the database (the rows wait for the next run), and
exits 0.
"""

from __future__ import annotations

import argparse

from pgonce.cli.serve import add_service_options, run_parts

NAME = "relay"
HELP = "run only the outbox relay"


def configure(parser: argparse.ArgumentParser) -> None:
    add_service_options(parser)


def run(args: argparse.Namespace) -> int:
    return run_parts(args, ("relay",))
