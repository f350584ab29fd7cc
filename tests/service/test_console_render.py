"""The console's drawing, without a browser or a database: buckets, backlogs, SVG and bodies."""

from __future__ import annotations

import json
from datetime import timedelta

from pgonce.service.console import charts
from pgonce.service.console.html import BODY_PREVIEW, body_block, body_text, page

HOUR = charts.WINDOWS["hour"]


def test_fill_makes_a_dense_series_and_drops_buckets_outside_the_window() -> None:
    assert charts.fill([(0, 2), (3, 5), (-1, 7), (60, 9), (3, 1)], 5) == [2, 0, 0, 6, 0]


def test_levels_start_from_what_waited_before_the_window() -> None:
    # 4 rows waited before; 2 arrive in bucket 0, 5 leave in bucket 2, one arrives late (clamped).
    assert charts.levels([(-1, 4), (0, 2), (2, -5), (99, 1)], 4) == [6, 6, 1, 2]
    assert charts.levels([(0, -3)], 2) == [0, 0]  # never below zero


def test_rates_are_per_minute_whatever_the_bucket() -> None:
    assert charts.per_minute([30, 0], timedelta(minutes=15)) == [2.0, 0.0]


def test_svg_escapes_names_and_draws_one_bar_per_nonzero_bucket() -> None:
    figure = charts.svg("<b>t</b>", {"<x>": [0.0] * 59 + [3.0]}, HOUR)
    assert "<b>" not in figure
    assert "&lt;x&gt;" in figure
    assert figure.count("<rect") == 1
    line = charts.svg("backlog", {"backlog": [1.0] * 60}, HOUR, kind="line", unit="rows")
    assert line.count("<polyline") == 1
    assert "style=" not in figure + line  # the page's CSP forbids inline styles


def test_a_body_is_text_or_escaped_bytes_never_markup() -> None:
    assert body_text("café".encode()) == ("text (UTF-8)", "café")
    label, text = body_text(b"a\xffb")
    assert text == "a\\xffb"
    assert "not valid UTF-8" in label
    block = body_block(b'<script>alert(1)</script>{"a": 1}', "Body")
    assert "<script>" not in block
    assert "&lt;script&gt;" in block


def test_json_is_indented_below_the_exact_text() -> None:
    data = b'{"b":1,  "a":[1,2]}'
    block = body_block(data, "Body")
    assert '<pre class="body">{&quot;b&quot;:1,  &quot;a&quot;:[1,2]}</pre>' in block
    assert json.dumps({"b": 1, "a": [1, 2]}, indent=2).replace('"', "&quot;") in block


def test_a_huge_body_is_cut_and_counted() -> None:
    block = body_block(b"x" * (BODY_PREVIEW + 10), "Body")
    assert "10 more bytes not shown" in block
    assert block.count("x" * 100) == BODY_PREVIEW // 100


def test_a_page_escapes_its_title_and_loads_nothing_inline() -> None:
    html = page("<img src=x>", "<p>body</p>", script=True)
    assert "<img src=x>" not in html
    assert "<style>" not in html
    assert '<script src="/admin/static/console.js" defer></script>' in html
