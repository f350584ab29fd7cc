"""The ORM model the SQLAlchemy adapter's tests write through."""

from __future__ import annotations

import psycopg
from psycopg import sql
from sqlalchemy import Integer, String
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


class Base(DeclarativeBase):
    pass


class Order(Base):
    __tablename__ = "orders"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    key: Mapped[str] = mapped_column(String, unique=True)
    amount: Mapped[int] = mapped_column(Integer, default=0)


def orders_and_rows(dsn: str, table: str) -> tuple[list[str], int]:
    """The orders' keys and the number of rows of pgonce's ``table``, as another connection
    sees them."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        orders = [r[0] for r in conn.execute("SELECT key FROM orders ORDER BY key")]
        query = sql.SQL("SELECT count(*) FROM pgonce.{}").format(sql.Identifier(table))
        row = conn.execute(query).fetchone()
    assert row is not None
    return orders, int(row[0])
