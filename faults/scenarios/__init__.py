"""The fault scenarios: each an ``async def scenario(ctx: Context) -> Result``, listed by name in
faults/__main__.py's ``SCENARIOS``.

What a scenario owes the report, so that its verdict cannot pass vacuously:

- its load is accounted from the database and the broker (faults/load.py), never from the
  producers' counters, and it checks a minimum sent and acknowledged before judging the rest
  (``MixedLoad(minimum=...)`` does it for the three producers);
- every fault it injects is recorded with its time window (``FaultLog.window`` or ``add``;
  ``MixedLoad.faults`` for a mixed load): only a recorded fault explains a broker copy published
  twice, and ``OutboxLoad.account`` fails on any other;
- the processes it starts keep their logs (``ctx.keep_logs``), which the run's last step scans
  for secrets and tracebacks.
"""
