"""Optional extras: the core imports none of them; a part without its extra names what to install.

Each check runs in a fresh interpreter, where an extra's libraries are made unimportable by putting
``None`` in ``sys.modules`` (what Python does for a module that is not installed is the same
``ModuleNotFoundError``).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

from pgonce.extras import EXTRAS

ROOT = Path(__file__).resolve().parent.parent
OPTIONAL = sorted({module for modules in EXTRAS.values() for module in modules})


def run_python(code: str, *, blocked: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    prelude = f"import sys\nfor _m in {list(blocked)!r}:\n    sys.modules[_m] = None\n"
    return subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(code)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
        check=False,
    )


def loaded_optional(statement: str) -> list[str]:
    result = run_python(
        f"""
        import json
        {statement}
        print(json.dumps(sorted({{m.partition(".")[0] for m in sys.modules}} & set({OPTIONAL!r}))))
        """
    )
    assert result.returncode == 0, result.stderr
    loaded: list[str] = json.loads(result.stdout)
    return loaded


@pytest.mark.parametrize(
    "statement",
    [
        "import pgonce",
        "import pgonce.cli; pgonce.cli.build_parser()",
        "import pgonce.webhooks.schemes",
        "import pgonce.store.migrate, pgonce.cli.sweep, pgonce.cli.doctor",
        "import pgonce.service.config",
    ],
)
def test_the_core_loads_no_optional_library(statement: str) -> None:
    assert loaded_optional(statement) == []


def test_the_core_works_with_every_extra_missing() -> None:
    result = run_python(
        """
        import pgonce, pgonce.cli
        from pgonce.webhooks.schemes import build_scheme
        build_scheme("standard-webhooks", ["whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"])
        assert pgonce.cli.main(["--help"]) == 0
        """,
        blocked=tuple(OPTIONAL),
    )
    # --help exits through SystemExit(0) after printing; nothing else may fail.
    assert result.returncode == 0, result.stderr
    assert "migrate" in result.stdout


def test_the_core_commands_run_with_a_configuration_file_and_no_extra(
    direct_dsn: str, tmp_path: Path
) -> None:
    """A job with $PGONCE_CONFIG and only the core installed migrates and sweeps: the file's
    database settings are read, its sources (a forward among them) are not built."""
    config = tmp_path / "pgonce.toml"
    config.write_text(
        '[database]\ndsn = "env:JOB_DSN"\n\n'
        '[sources.shop]\nscheme = "stripe"\nsecrets = "env:SHOP_SECRET"\n'
        'forward = "https://orders.example/hooks"\n'
    )
    result = run_python(
        f"""
        import os
        os.environ.pop("PGONCE_DSN", None)
        os.environ["JOB_DSN"] = {direct_dsn!r}
        os.environ["PGONCE_CONFIG"] = {str(config)!r}
        from pgonce.cli import main
        assert main(["migrate"]) == 0
        sys.exit(main(["sweep"]))
        """,
        blocked=tuple(OPTIONAL),
    )
    assert result.returncode == 0, result.stderr
    assert "pip install" not in result.stderr


@pytest.mark.parametrize(
    ("module", "extra"),
    [
        ("pgonce.http.transaction", "asgi"),
        ("pgonce.http.middleware", "asgi"),
        ("pgonce.webhooks.receiver", "asgi"),
        ("pgonce.service.app", "server"),
        ("pgonce.publishers.rabbitmq", "rabbitmq"),
        ("pgonce.publishers.nats", "nats"),
        ("pgonce.publishers.redis_streams", "redis"),
        ("pgonce.publishers.http", "http"),
        ("pgonce.webhooks.forward", "http"),
        ("pgonce.contrib.flask", "flask"),
        ("pgonce.contrib.sqlalchemy", "sqlalchemy"),
        ("pgonce.contrib.django", "django"),
        ("pgonce.contrib.django.middleware", "django"),
        ("pgonce.contrib.django.outbox", "django"),
        ("pgonce.contrib.django.scopes", "django"),
    ],
)
def test_a_part_without_its_extra_names_the_install_command(module: str, extra: str) -> None:
    result = run_python(
        f"""
        from pgonce.errors import MissingExtra, UsageError
        try:
            import {module}
        except MissingExtra as error:
            assert isinstance(error, ImportError) and isinstance(error, UsageError)
            print(error.extra, "|", error)
        """,
        blocked=EXTRAS[extra],
    )
    assert result.returncode == 0, result.stderr
    name, _, message = result.stdout.strip().partition(" | ")
    assert name == extra
    assert f"pip install 'pgonce[{extra}]'" in message


def test_the_wsgi_and_django_adapters_need_no_asgi_library() -> None:
    """The HTTP semantics they share live in pgonce.http, whose ASGI parts load only when named."""
    result = run_python(
        """
        import pgonce.contrib.wsgi, pgonce.contrib.flask
        from pgonce.http import semantics
        from pgonce.errors import MissingExtra
        try:
            from pgonce.http import IdempotencyMiddleware
        except MissingExtra as error:
            print(error.extra)
        """,
        blocked=EXTRAS["asgi"][:1],  # starlette; psycopg_pool is the wsgi extra's too
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "asgi"  # the ASGI middleware, named, still says what to add


def test_a_v1a_key_without_cryptography_names_the_ed25519_extra() -> None:
    result = run_python(
        """
        from pgonce.errors import MissingExtra
        from pgonce.webhooks.schemes import build_scheme
        try:
            build_scheme("standard-webhooks", ["whpk_" + "A" * 43 + "="])
        except MissingExtra as error:
            print(error)
        """,
        blocked=EXTRAS["ed25519"],
    )
    assert result.returncode == 0, result.stderr
    assert "pip install 'pgonce[ed25519]'" in result.stdout


@pytest.mark.parametrize(
    ("argv", "extra"),
    [
        (["serve", "--dsn", "postgresql://127.0.0.1:1/x"], "server"),
        (["send", "--source", "shop"], "http"),
        # Said before the database is reached (and migrated), not after.
        (["demo", "--dsn", "postgresql://127.0.0.1:1/x"], "server"),
        (["migrate"], "embedded"),  # no DSN: the embedded PostgreSQL is what is missing
    ],
)
def test_a_command_without_its_extra_is_one_line_naming_it(argv: list[str], extra: str) -> None:
    result = run_python(
        f"""
        import os
        os.environ.pop("PGONCE_DSN", None)
        from pgonce.cli import main
        sys.exit(main({argv!r}))
        """,
        blocked=tuple(OPTIONAL),
    )
    assert result.returncode == 1
    assert result.stderr.startswith("pgonce: error: ")
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert f"pip install 'pgonce[{extra}]'" in result.stderr


def test_the_extras_table_matches_pyproject() -> None:
    """Each extra of ``EXTRAS`` is declared, and its distributions provide exactly its modules."""
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    providers = importlib.metadata.packages_distributions()
    for extra, modules in EXTRAS.items():
        assert extra in declared, extra
        wanted = {_distribution(requirement) for requirement in declared[extra]}
        provided = {m for m in modules if _normal(providers.get(m, [""])[0]) in wanted}
        assert provided == set(modules), (extra, modules, wanted)
    # `all` names every other extra, so that `pip install 'pgonce[all]'` is everything.
    (everything,) = declared["all"]
    named = set(re.findall(r"[\w-]+", everything.partition("[")[2]))
    assert named == set(declared) - {"all"}


def _distribution(requirement: str) -> str:
    name = re.match(r"[A-Za-z0-9_.-]+", requirement)
    assert name is not None
    return _normal(name.group())


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_version_has_one_source() -> None:
    from pgonce import __version__

    result = subprocess.run(
        [sys.executable, "-m", "pgonce", "--version"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.stdout.strip() == f"pgonce {__version__}"
    assert importlib.metadata.version("pgonce") == __version__
