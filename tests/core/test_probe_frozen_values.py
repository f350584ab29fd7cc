"""Every frozen value of pgonce refuses a change with FrozenInstanceError, whatever the name.

A dataclass made with ``frozen=True, slots=True`` answers an assignment to a name that is not one
of its fields (a misspelt field), and every deletion, with CPython's ``TypeError: super(type,
obj): obj must be an instance or subtype of type``. ``refuse_changes`` (pgonce.core.frozen) gives
each of pgonce's such dataclasses the refusal its fields get; the first test finds them in the
source, so that a new one without it fails here.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import pickle
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

import pgonce
from pgonce import Response
from pgonce.config import Settings
from pgonce.core.frozen import refuse_changes
from pgonce.core.outcomes import won

SOURCE = Path(pgonce.__file__).parent


def _frozen_slotted(path: Path) -> list[tuple[str, bool]]:
    """(class name, whether refuse_changes decorates it) for each class of ``path`` decorated
    with ``@dataclass(frozen=True, slots=True, ...)``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.ClassDef):
            continue
        names = []
        for decorator in node.decorator_list:
            if isinstance(decorator, ast.Call) and ast.unparse(decorator.func) == "dataclass":
                flags = {k.arg: ast.unparse(k.value) for k in decorator.keywords}
                if flags.get("frozen") == "True" and flags.get("slots") == "True":
                    names.append("dataclass")
            elif ast.unparse(decorator) == "refuse_changes":
                names.append("refuse_changes")
        if "dataclass" in names:
            # Above the dataclass: it needs the class dataclass() made.
            refused = "refuse_changes" in names and names.index("refuse_changes") < names.index(
                "dataclass"
            )
            found.append((node.name, refused))
    return found


def _module(path: Path) -> str:
    return ".".join(("pgonce", *path.relative_to(SOURCE).with_suffix("").parts))


CLASSES = sorted(
    (_module(path), name) for path in SOURCE.rglob("*.py") for name, _ in _frozen_slotted(path)
)


def test_every_frozen_slotted_dataclass_refuses_changes() -> None:
    missing = [
        f"{path.relative_to(SOURCE)}: {name}"
        for path in sorted(SOURCE.rglob("*.py"))
        for name, refused in _frozen_slotted(path)
        if not refused
    ]
    assert len(CLASSES) > 60  # the search finds them (68 when this was written)
    assert not missing, (
        f"@refuse_changes missing above @dataclass(frozen=True, slots=True): {missing}"
    )


@pytest.mark.parametrize(
    ("module", "name"),
    [c for c in CLASSES if not c[0].startswith("pgonce.contrib.django")],
    ids=lambda value: value,
)
def test_each_refuses_an_unknown_name_and_a_deletion(module: str, name: str) -> None:
    cls: Any = getattr(importlib.import_module(module), name)
    value = object.__new__(cls)  # no constructor arguments needed: the refusal is the class's
    field = dataclasses.fields(cls)[0].name
    for name_changed in ("no_such_field", field):
        with pytest.raises(dataclasses.FrozenInstanceError, match=cls.__name__):
            setattr(value, name_changed, 1)
        with pytest.raises(dataclasses.FrozenInstanceError, match=cls.__name__):
            delattr(value, name_changed)


def test_a_misspelt_field_is_named_with_the_fields() -> None:
    response = Response(201, (("content-type", "application/json"),), b"{}")
    with pytest.raises(AttributeError) as refused:
        response.stauts = 200  # type: ignore[attr-defined]
    assert isinstance(refused.value, dataclasses.FrozenInstanceError)
    assert str(refused.value) == (
        "cannot assign to 'stauts': a Response is frozen, and its fields are status, headers, body"
    )
    with pytest.raises(dataclasses.FrozenInstanceError, match="cannot assign to field 'status'"):
        response.status = 200  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError, match="cannot delete field 'body'"):
        del response.body
    settings = Settings()
    with pytest.raises(dataclasses.FrozenInstanceError, match="its fields are dsn, schema, "):
        settings.scheme = "other"  # type: ignore[attr-defined]
    assert response == Response(201, (("content-type", "application/json"),), b"{}")


def test_values_made_without_init_are_refused_too() -> None:
    # The key store's outcomes are made from a twin of their slots (core/outcomes.py).
    claim = won("scope", "key", b"f" * 32, datetime(2026, 1, 2, tzinfo=UTC))
    with pytest.raises(dataclasses.FrozenInstanceError):
        claim.scope = "other"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        claim.token = 1  # type: ignore[attr-defined]


def test_values_still_copy_pickle_and_replace() -> None:
    response = Response(200, (), b"ok")
    assert pickle.loads(pickle.dumps(response)) == response
    assert dataclasses.replace(response, status=201).status == 201


def test_refuse_changes_refuses_what_is_not_a_frozen_slotted_dataclass() -> None:
    @dataclasses.dataclass(frozen=True)
    class Unslotted:
        x: int

    @dataclasses.dataclass(slots=True)
    class Unfrozen:
        x: int

    for cls in (Unslotted, Unfrozen, int):
        with pytest.raises(TypeError, match="frozen, slotted dataclasses"):
            refuse_changes(cls)
