"""The store layer: the only code that runs SQL.

Every call takes the caller's connection, so pgonce's writes commit with the caller's own. The async
code in ``_async/`` is the source; ``_sync/`` is generated from it by ``tools/gen_sync.py`` (``make
lint`` fails when they drift). Database errors are translated here, once, into pgonce's tree.
"""
