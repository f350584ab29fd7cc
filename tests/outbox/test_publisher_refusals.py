"""The refusal every publisher makes of a row its routing function fails for, in one place."""

from __future__ import annotations

from datetime import UTC, datetime

from pgonce.core.outbox import OutboxMessage
from pgonce.publishers.base import ROUTING_FAILED, by_aggregatetype, route_or_refuse


def message(row_id: int = 1) -> OutboxMessage:
    return OutboxMessage(row_id, "order", "1", "created", "{}", {}, datetime.now(UTC), 0)


def test_a_name_is_returned_and_nothing_is_refused() -> None:
    refused: dict[int, str] = {}
    kinds: dict[int, str] = {}
    assert route_or_refuse(by_aggregatetype("shop."), message(), refused, kinds) == "shop.order"
    assert refused == {}
    assert kinds == {}


def test_a_routing_function_that_raises_refuses_its_row_with_the_first_line_cut_short() -> None:
    def route(message: OutboxMessage) -> str:
        raise LookupError(f"no destination for {'x' * 300}\nsecond line")

    refused: dict[int, str] = {}
    kinds: dict[int, str] = {}
    assert route_or_refuse(route, message(7), refused, kinds) is None
    assert refused[7].startswith("the routing function raised LookupError: no destination for x")
    assert refused[7].endswith("...")
    assert "second line" not in refused[7]
    assert kinds == {7: ROUTING_FAILED}


def test_a_routing_function_that_returns_no_str_refuses_its_row() -> None:
    refused: dict[int, str] = {}
    kinds: dict[int, str] = {}
    assert route_or_refuse(lambda row: None, message(3), refused, kinds) is None  # type: ignore[arg-type]
    assert refused == {3: "the routing function returned NoneType, not a str"}
    assert kinds == {3: ROUTING_FAILED}
