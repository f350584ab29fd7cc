"""A streamed body for the Django tests: an iterator that is not a generator, whose ``close()``
writes a payment."""

from __future__ import annotations

from collections.abc import Iterator

from examples.django_payments.payments.models import Payment

CHUNK = b"." * 100


class Parts:
    """``count`` chunks of :data:`CHUNK`; ``close()`` writes a payment: on every call, or with
    ``write_once`` on the first only (as a generator's close does nothing the second time)."""

    def __init__(self, count: int, *, write_once: bool = False) -> None:
        self.left = count
        self.write_once = write_once
        self.closed = False

    def __iter__(self) -> Iterator[bytes]:
        return self

    def __next__(self) -> bytes:
        if not self.left:
            raise StopIteration
        self.left -= 1
        return CHUNK

    def close(self) -> None:
        if self.write_once and self.closed:
            return
        self.closed = True
        Payment.objects.create(principal="close", amount=1, currency="EUR")
