"""Payments on Django: POST /payments is safe to retry with an Idempotency-Key (see settings.py)."""
