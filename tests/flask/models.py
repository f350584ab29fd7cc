"""The ORM model the Flask + SQLAlchemy tests write (as Flask-SQLAlchemy sets one up), and their
read of it."""

from __future__ import annotations

import psycopg
from sqlalchemy import BigInteger
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


class Base(DeclarativeBase):
    pass


class Payment(Base):
    __tablename__ = "orm_payments"
    id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    amount: Mapped[int] = mapped_column(BigInteger)


def rows(dsn: str) -> list[tuple[int, int]]:
    with psycopg.connect(dsn) as conn:
        return [(r[0], r[1]) for r in conn.execute("SELECT id, amount FROM orm_payments")]
