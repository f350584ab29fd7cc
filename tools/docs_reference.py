"""The documentation's reference pages, generated from the one place each thing is defined.

A page asks for a table with a marker line, ``<!-- pgonce:NAME -->``; the MkDocs hook
(``tools/docs_hooks.py``) replaces it with ``GENERATORS[NAME]()``. Nothing here is copied by hand:

- ``config``: every key of the service's TOML file, read by running ``pgonce.service.config.load``
  with its section readers recorded, so that a key added to the loader appears here by itself;
- ``cli``: every command's ``--help``, from ``pgonce.cli.build_parser()``;
- ``metrics``: every metric family of ``pgonce.service.metrics.ServiceMetrics``;
- ``problems``: every problem (status and title) pgonce answers over HTTP, from the exception
  classes that carry one and from the literal ``send_problem(...)`` calls in the source.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import functools
import inspect
import os
import tempfile
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "src" / "pgonce"

#: The section readers of the configuration loader, and the type each reads.
READERS = {
    "text": "string",
    "optional_text": "string",
    "integer": "integer",
    "duration": "duration",
    "boolean": "boolean",
    "secrets": 'list of "env:NAME"',
    "raw": "table",
}

# A configuration that reaches every reader: one source and an outbox. Its values are
# placeholders for the loader; the table shows the defaults, never these.
_SAMPLE = """
[sources.NAME]
scheme = "standard-webhooks"
secrets = ["env:PGONCE_DOCS_SECRET"]

[outbox]
publisher = "http"
url = "https://example.invalid/hook"
secret = "env:PGONCE_DOCS_SECRET"
"""


def _text(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, timedelta):
        from pgonce.core.retention import format_duration

        return f"`{format_duration(value)}`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, str):
        return f'`"{value}"`' if value else '`""`'
    return f"`{value}`"


def _recorded_keys() -> list[tuple[str, str, str, Any]]:
    """``(section, key, type, default)`` of every key the loader reads, in reading order."""
    from pgonce.service import config

    seen: dict[tuple[str, str], tuple[str, str, str, Any]] = {}
    originals = {name: getattr(config._Section, name) for name in READERS}

    def recording(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def read(section: Any, key: str, *args: Any, **kwargs: Any) -> Any:
            default = args[0] if args else kwargs.get("default")
            if name in ("optional_text", "secrets", "raw"):
                default = None
            if section.path:  # the root's reads are the sections themselves
                seen.setdefault((section.path, key), (section.path, key, READERS[name], default))
            return original(section, key, *args, **kwargs)

        return read

    with tempfile.TemporaryDirectory() as folder:
        sample = Path(folder) / "pgonce.toml"
        sample.write_text(_SAMPLE)
        environ = {"PGONCE_DOCS_SECRET": "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"}
        try:
            for name, original in originals.items():
                setattr(config._Section, name, recording(name, original))
            config.load(sample, environ)
        finally:
            for name, original in originals.items():
                setattr(config._Section, name, original)
    return list(seen.values())


def config_reference() -> str:
    rows = [
        "| section | key | type | default | environment override |",
        "|---|---|---|---|---|",
    ]
    for section, key, kind, default in _recorded_keys():
        env = "PGONCE__" + "__".join(part.upper() for part in [*section.split("."), key])
        if (section, key) == ("database", "dsn"):
            env += " (or PGONCE_DSN)"
        elif (section, key) in (("database", "schema"), ("database", "data_dir")):
            env += f" (or PGONCE_{key.upper()})"
        shown = "embedded PostgreSQL" if (section, key) == ("database", "dsn") else _text(default)
        rows.append(f"| `[{section}]` | `{key}` | {kind} | {shown} | `{env}` |")
    return "\n".join(rows)


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


@contextlib.contextmanager
def _columns(width: int) -> Iterator[None]:
    # argparse wraps at the terminal's width; the reference must not depend on who builds it.
    before = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(width)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = before


def cli_reference() -> str:
    from pgonce.cli import COMMANDS, build_parser

    with _columns(100):
        parser = build_parser()
        children = _subcommands(parser)
        parts = [
            "| command | what it does |",
            "|---|---|",
            *(f"| [`pgonce {c.NAME}`](#pgonce-{c.NAME}) | {c.HELP} |" for c in COMMANDS),
            "",
            "## pgonce",
            "",
            "```text",
            parser.format_help().rstrip(),
            "```",
        ]
        for command in COMMANDS:
            child = children[command.NAME]
            parts += ["", f"## pgonce {command.NAME}", "", "```text"]
            parts += [child.format_help().rstrip(), "```"]
            for name, grandchild in _subcommands(child).items():
                parts += ["", f"### pgonce {command.NAME} {name}", "", "```text"]
                parts += [grandchild.format_help().rstrip(), "```"]
    return "\n".join(parts)


def metrics_reference() -> str:
    from pgonce.service.metrics import ServiceMetrics

    metrics = ServiceMetrics()
    labels = metrics.label_names()
    rows = ["| metric | type | labels | what it counts |", "|---|---|---|---|"]
    for family in metrics.registry.collect():
        name = family.name + ("_total" if family.type == "counter" else "")
        # Every family is in label_names(): a family defined elsewhere fails the build here.
        names = ", ".join(f"`{label}`" for label in labels[family.name]) or "—"
        help_text = family.documentation.replace("|", "\\|")
        rows.append(f"| `{name}` | {family.type} | {names} | {help_text} |")
    return "\n".join(rows)


#: The calls that answer a problem, and where in their arguments the status stands: the ASGI
#: helper ``send_problem(send, 409, "Title", ...)`` and the shared semantics'
#: ``problem(409, "Title", ...)``.
_PROBLEM_CALLS = {"send_problem": 1, "problem": 0}


def _literal_problems() -> Iterator[tuple[str, int, str]]:
    """``(module, status, title)`` of every problem answered with a literal status and title."""
    for path in sorted(SOURCE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
                continue
            first = _PROBLEM_CALLS.get(node.func.id)
            if first is None or len(node.args) < first + 2:
                continue
            status, title = node.args[first], node.args[first + 1]
            if (
                isinstance(status, ast.Constant)
                and isinstance(status.value, int)
                and isinstance(title, ast.Constant)
            ):
                module = path.relative_to(SOURCE.parent).with_suffix("").as_posix()
                yield module.replace("/", "."), int(status.value), str(title.value)


def problems_reference() -> str:
    from pgonce import errors

    rows = ["| status | title | answered by | when |", "|---|---|---|---|"]
    for _, cls in inspect.getmembers(errors, inspect.isclass):
        status, title = getattr(cls, "status", None), getattr(cls, "title", None)
        if cls.__module__ != errors.__name__ or status is None or title is None:
            continue
        when = " ".join((cls.__doc__ or "").strip().split("\n\n")[0].split())
        where = "the webhook receiver" if issubclass(cls, errors.WebhookError) else "middleware"
        rows.append(f"| {status} | {title} | {where} (`{cls.__name__}`) | {when} |")
    for module, status, title in sorted(set(_literal_problems()), key=lambda p: (p[1], p[0])):
        rows.append(f"| {status} | {title} | `{module}` | see the module's guide |")
    return "\n".join(rows)


GENERATORS: dict[str, Callable[[], str]] = {
    "config": config_reference,
    "cli": cli_reference,
    "metrics": metrics_reference,
    "problems": problems_reference,
}
