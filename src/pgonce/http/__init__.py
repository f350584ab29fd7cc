"""HTTP edges: the Idempotency-Key middleware and RFC 9457 problem responses."""
