"""The fault tests' shared fixture: each module gets the suite's own servers."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest

from faults.context import Context, open_context
from tests import logscan

#: Set to rerun with the seed a failure printed.
SEED_ENV = "PGONCE_FAULTS_SEED"


@pytest.fixture(scope="module")
def ctx() -> Iterator[Context]:
    """The suite's own servers for this module. The processes' logs stay in the session's folder
    of logs, which the session scans after the last test (tests/logscan.py)."""
    folder = logscan.module_folder()
    seed = int(os.environ.get(SEED_ENV) or time.time())
    with open_context(folder, quick=True, seed=seed) as context:
        try:
            yield context
        finally:
            logscan.record(
                folder,
                logs=context.logs,
                secrets=context.secrets.all(),
                bodies=context.bodies,
            )
