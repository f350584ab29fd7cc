"""The example's routes plus the endpoints that misbehave on purpose (as tests/http/app.py)."""

from __future__ import annotations

from django.urls import path

from examples.django_payments.urls import urlpatterns as example
from tests.django import views

urlpatterns = [
    *example,
    path("boom", views.boom),
    path("fail", views.fail),
    path("cookie", views.cookie),
    path("stream", views.stream),
    path("no-db", views.no_db),
    path("stream-write", views.stream_write),
    path("raise-after-write", views.raise_after_write),
    path("drf/raise-after-write", views.RaiseAfterWriteDRF.as_view()),
    path("lose-connection", views.lose_connection),
    path("block", views.block),
    path("swallow-db-error", views.swallow_db_error),
    path("rollback-and-write-anew", views.rollback_and_write_anew),
    path("committed-hook", views.committed_hook),
    path("mark-for-rollback", views.mark_for_rollback),
    path("mark-own-block-for-rollback", views.mark_own_block_for_rollback),
    path("undo-a-part-then-write", views.undo_a_part_then_write),
    path("commit-the-request", views.commit_the_request),
    path("end-on-psycopg", views.end_on_psycopg),
    path("hook-without-query", views.hook_without_query),
    path("durable-block", views.durable_block),
    path("broken-reference", views.broken_reference),
    path("no-savepoint-caught", views.no_savepoint_caught),
]
