"""The relay's and the inbox worker's lookup of the setting that cut a statement runs under that
setting, so a short statement_timeout can cut the lookup too (a loaded server, a timeout of a
millisecond or two): the lookup is asked again within its second, and the report still names the
value.

The first lookup is made to outlast the timeout for real: the lookup's ``current_setting()`` is
found first in a schema the connection's search_path puts before pg_catalog, whose function
sleeps through the timeout on its first call and answers as PostgreSQL's own after that.
"""

from __future__ import annotations

import psycopg

from pgonce.store.timeouts import server_setting

#: A current_setting() that sleeps through the timeout on the calls up to ``slow.calls_cut``.
SLOW_LOOKUP = """
CREATE SCHEMA slow;
CREATE SEQUENCE slow.calls;  -- not rolled back with the statement the timeout cuts
CREATE FUNCTION slow.current_setting(name text) RETURNS text LANGUAGE plpgsql AS $$
BEGIN
    IF nextval('slow.calls') <= %s THEN
        PERFORM pg_sleep(5);
    END IF;
    RETURN pg_catalog.current_setting(name);
END $$;
"""
OPTIONS = "-c search_path=slow,pg_catalog -c statement_timeout=200"


def _slow_lookups(dsn: str, cut: int) -> None:
    """The first ``cut`` lookups on ``dsn``'s database outlast a 200 ms statement_timeout."""
    with psycopg.connect(dsn, autocommit=True) as admin:
        admin.execute(SLOW_LOOKUP.replace("%s", str(cut)).encode())


def _lookups(dsn: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as admin:
        row = admin.execute("SELECT last_value FROM slow.calls").fetchone()
    assert row is not None
    return int(row[0])


async def test_a_lookup_cut_by_the_timeout_it_reads_is_asked_again(direct_dsn: str) -> None:
    _slow_lookups(direct_dsn, cut=2)
    async with await psycopg.AsyncConnection.connect(direct_dsn, options=OPTIONS) as conn:
        assert await server_setting(conn, "statement_timeout") == {"statement_timeout": "200ms"}
    assert _lookups(direct_dsn) == 3, "two lookups were cut, the third answered"


async def test_a_lookup_cut_for_its_whole_second_gives_no_value(direct_dsn: str) -> None:
    _slow_lookups(direct_dsn, cut=1000)
    async with await psycopg.AsyncConnection.connect(direct_dsn, options=OPTIONS) as conn:
        assert await server_setting(conn, "statement_timeout") == {}
    # Five lookups fit in the second at 200 ms each, and the sixth is cancelled with it.
    assert 2 <= _lookups(direct_dsn) <= 6
