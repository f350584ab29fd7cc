"""Frozen values that refuse a change as frozen values: :func:`refuse_changes`.

A dataclass made with ``frozen=True`` and ``slots=True`` refuses an assignment to one of its
fields with :class:`dataclasses.FrozenInstanceError`, but answers an assignment to any other name
(a misspelt field: ``response.stauts = 200``) and every deletion with CPython's ``TypeError:
super(type, obj): obj must be an instance or subtype of type``: the ``__setattr__`` it generates
names the class as it was before ``slots=True`` made a new one (CPython 3.11 to 3.13). pgonce's
values (outcomes, events, settings) are all such dataclasses, and a misuse gets a clear, typed
error at the call.
"""

from __future__ import annotations

from dataclasses import FrozenInstanceError, fields
from typing import Any, TypeVar

_T = TypeVar("_T", bound=type)


def refuse_changes(cls: _T) -> _T:
    """Give the frozen, slotted dataclass ``cls`` a ``__setattr__`` and ``__delattr__`` that
    refuse every change with :class:`~dataclasses.FrozenInstanceError` (an
    :class:`AttributeError`), naming the class and, for a name that is not a field, its fields.

    Apply it above ``@dataclass(frozen=True, slots=True)``. The dataclass's own ``__init__``
    sets its fields without ``__setattr__``, so making a value costs nothing more.
    """
    params = getattr(cls, "__dataclass_params__", None)
    if params is None or not params.frozen or "__slots__" not in cls.__dict__:
        raise TypeError(f"refuse_changes() is for frozen, slotted dataclasses, not {cls!r}")
    ordered = [field.name for field in fields(cls)]
    names = frozenset(ordered)
    listed = ", ".join(ordered)
    title = cls.__name__

    def refusal(name: str, doing: str) -> FrozenInstanceError:
        if name in names:
            return FrozenInstanceError(f"cannot {doing} field {name!r}: a {title} is frozen")
        return FrozenInstanceError(
            f"cannot {doing} {name!r}: a {title} is frozen, and its fields are {listed}"
        )

    def __setattr__(self: Any, name: str, value: Any) -> None:
        raise refusal(name, "assign to")

    def __delattr__(self: Any, name: str) -> None:
        raise refusal(name, "delete")

    __setattr__.__qualname__ = f"{cls.__qualname__}.__setattr__"
    __delattr__.__qualname__ = f"{cls.__qualname__}.__delattr__"
    cls.__setattr__ = __setattr__  # type: ignore[assignment]
    cls.__delattr__ = __delattr__  # type: ignore[assignment]
    return cls
