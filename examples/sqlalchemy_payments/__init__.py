"""Payments on FastAPI + SQLAlchemy (async ORM), safe to retry with an Idempotency-Key."""
