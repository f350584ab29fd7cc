"""The soak runner (`make soak`, `python -m faults.soak`): long-horizon behaviour by phase.

pgonce's three paths (Idempotency-Key requests on the example app, signed webhooks to
``pgonce serve`` with the demo handler, outbox rows relayed to Redis Streams) and pgqueuer with a
no-op job run at a fixed offered rate through phases given in order (baseline, idle-in-tx,
high-load, active-readers, pg-backend-kill, pool-exhaustion, recovery), on the fault suite's own
PostgreSQL (never a shared server) with ``max_connections`` set high enough for the
pool-exhaustion phase (faults/pg.py). The report, faults/results/soak-<profile>.md, has a table
per phase with the issue's targets beside the measured values, and PNG plots over time.
"""
