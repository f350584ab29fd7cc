"""The secrets-and-tracebacks scan of every process the test suite's fault tests started.

The processes' logs are written under one folder of the session, whatever the test runner's
parallelism: the controlling process creates it and hands it to the xdist workers through the
environment (as it hands them the PostgreSQL DSN), and each fault-test module writes its run's
logs, secrets and captured refusal bodies in a folder of its own under it. After the last test,
the controlling process scans everything at once (faults.scenarios.security.scan): a secret in any
log or refusal, a traceback in any log, or a scan that read fewer lines than its processes always
write fails the session. Nothing is scanned when no fault test ran.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import uuid
from pathlib import Path

import pytest

from faults.report import section
from faults.scenarios.security import scan

#: The session's folder of logs, set by the controlling process for its workers.
ENV = "PGONCE_TEST_LOGS"
#: What a module's folder holds besides its logs.
SECRETS = "secrets.json"
BODIES = "bodies"
LOGS = "logs.json"


def configure(config: pytest.Config) -> None:
    if hasattr(config, "workerinput"):
        return
    os.environ[ENV] = tempfile.mkdtemp(prefix="pgonce-test-logs-")


def module_folder() -> Path:
    """A fresh folder for one module's processes, under the session's folder."""
    folder = Path(os.environ[ENV]) / f"run-{uuid.uuid4().hex[:12]}"
    folder.mkdir()
    return folder


def record(folder: Path, *, logs: set[Path], secrets: list[str], bodies: list[bytes]) -> None:
    """What the session's scan needs from one module: its processes' logs, its secrets (generated
    for the test run, never real ones) and the refusal bodies it captured."""
    (folder / LOGS).write_text(json.dumps(sorted(str(p) for p in logs)))
    (folder / SECRETS).write_text(json.dumps(secrets))
    (folder / BODIES).mkdir(exist_ok=True)
    for i, body in enumerate(bodies):
        (folder / BODIES / f"{i}.bin").write_bytes(body)


def finish(session: pytest.Session) -> None:
    """In the controlling process: scan every module's folder; fail the session on a finding."""
    if hasattr(session.config, "workerinput") or ENV not in os.environ:
        return
    root = Path(os.environ[ENV])
    try:
        runs = sorted(p for p in root.iterdir() if p.is_dir())
        if not runs:
            return
        logs: list[Path] = []
        secrets: list[str] = []
        bodies: list[bytes] = []
        for run in runs:
            if not (run / LOGS).exists():
                # A module that started and was cut off before its teardown: nothing to judge.
                continue
            logs += [Path(p) for p in json.loads((run / LOGS).read_text())]
            secrets += json.loads((run / SECRETS).read_text())
            bodies += [b.read_bytes() for b in sorted((run / BODIES).iterdir())]
        result = scan(logs, secrets, bodies)
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        summary = f"{result.load}: " + ("clean" if result.passed else "FAILED")
        if reporter is not None:
            reporter.write_line("")
            reporter.write_sep("=", "secrets and tracebacks in the fault tests' logs")
            reporter.write_line(summary)
            if not result.passed:
                reporter.write_line("\n".join(section(result)))
        if not result.passed:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
    finally:
        shutil.rmtree(root, ignore_errors=True)
