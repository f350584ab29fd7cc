"""The broker fixtures of the outbox tests (a test is skipped when its broker does not answer)."""

from tests.outbox.conftest import rabbitmq_url

__all__ = ["rabbitmq_url"]
