"""Two-phase keys: a request that calls a third party now and answers with its result.

The claim commits at once with a lease and a fencing token; each phase is a short transaction that
records its recovery point with its own writes; a third party is called outside any transaction
with an idempotency key derived from the pgonce key and the phase; the final answer is stored with
the token. A retry after a crash takes the key over with a larger token and resumes after the
last recorded point; the old holder's writes are refused (:class:`~pgonce.errors.LeaseLost`).
The completer finishes requests every client gave up on: one pass is ``complete()`` of a store,
:func:`complete_every` runs passes in a loop, as ``pgonce serve`` does. See
docs/concepts/choosing-a-mode.md.
"""

from pgonce.core.leases import DEFAULT_LEASE, Abandoned, CompleterPass, provider_key
from pgonce.errors import LeaseLost
from pgonce.store._async.phases import AsyncPhasedOperation, AsyncPhaseStore, complete_every
from pgonce.store._sync.phases import PhasedOperation, PhaseStore

__all__ = [
    "DEFAULT_LEASE",
    "Abandoned",
    "AsyncPhaseStore",
    "AsyncPhasedOperation",
    "CompleterPass",
    "LeaseLost",
    "PhaseStore",
    "PhasedOperation",
    "complete_every",
    "provider_key",
]
