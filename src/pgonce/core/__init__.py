"""Pure decisions, no I/O: fingerprints, claim outcomes, validation.

Nothing here imports psycopg or a web framework, so every rule is tested in milliseconds.
"""
