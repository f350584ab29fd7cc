"""Charts drawn on the server as inline SVG: no chart library, no script, nothing to load.

The database answers with sparse buckets (``(bucket, count)``, only buckets with rows; bucket -1
for "before the window"): :func:`fill` makes a dense series of them, :func:`levels` turns the
changes of a backlog (+1 in, -1 out) into its level at the end of each bucket, and :func:`svg`
draws one or more series as bars (stacked) or a line. Every label is escaped.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from html import escape

from pgonce.core.frozen import refuse_changes

WIDTH, HEIGHT, PAD_LEFT, PAD_BOTTOM, PAD_TOP = 420, 150, 44, 18, 8


@refuse_changes
@dataclass(frozen=True, slots=True)
class Window:
    """A chart window: ``buckets`` buckets of ``step`` each, ending now."""

    name: str
    step: timedelta
    buckets: int

    @property
    def span(self) -> timedelta:
        return self.step * self.buckets


WINDOWS = {
    "hour": Window("hour", timedelta(minutes=1), 60),
    "day": Window("day", timedelta(minutes=15), 96),
}


def fill(rows: Iterable[tuple[int, int]], buckets: int) -> list[int]:
    """A dense series of ``buckets`` values from sparse ``(bucket, value)`` rows; rows outside
    the window (a clock a little ahead, bucket -1) are left out."""
    series = [0] * buckets
    for bucket, value in rows:
        if 0 <= bucket < buckets:
            series[bucket] += int(value)
    return series


def levels(rows: Iterable[tuple[int, int]], buckets: int) -> list[int]:
    """A backlog's level at the end of each bucket, from its changes per bucket (-1: before)."""
    changes = dict[int, int]()
    for bucket, delta in rows:
        key = max(-1, min(bucket, buckets - 1))
        changes[key] = changes.get(key, 0) + int(delta)
    level = changes.get(-1, 0)
    out = []
    for bucket in range(buckets):
        level += changes.get(bucket, 0)
        out.append(max(0, level))
    return out


def per_minute(series: Sequence[int], step: timedelta) -> list[float]:
    minutes = step / timedelta(minutes=1)
    return [value / minutes for value in series]


def _number(value: float) -> str:
    if value >= 100 or value == int(value):
        return f"{value:,.0f}"
    return f"{value:.2g}"


#: Series colours, in drawing order (bars stack in this order).
COLOURS = {
    "done": "#17803d",
    "skipped": "#8a94a6",
    "pending": "#d08a00",
    "dead": "#b42318",
    "rate": "#2f5bb7",
    "backlog": "#7a3fb0",
}


def svg(
    title: str,
    series: Mapping[str, Sequence[float]],
    window: Window,
    *,
    kind: str = "bars",
    unit: str = "per minute",
) -> str:
    """A ``<figure>`` with an SVG chart of ``series`` (name -> values, one per bucket)."""
    count = window.buckets
    plot_w, plot_h = WIDTH - PAD_LEFT - 4, HEIGHT - PAD_BOTTOM - PAD_TOP
    totals = [sum(values[i] for values in series.values()) for i in range(count)]
    top = max([*totals, 0.0]) if kind == "bars" else max([0.0, *(max(v) for v in series.values())])
    scale = plot_h / top if top > 0 else 0.0
    slot = plot_w / count
    parts = [
        f'<svg viewBox="0 0 {WIDTH} {HEIGHT}" width="{WIDTH}" height="{HEIGHT}" role="img" '
        f'aria-label="{escape(title)}">',
        f'<line x1="{PAD_LEFT}" y1="{PAD_TOP + plot_h}" x2="{WIDTH - 4}" y2="{PAD_TOP + plot_h}" '
        'stroke="#c4c9d2"/>',
        f'<text x="{PAD_LEFT - 4}" y="{PAD_TOP + 8}" text-anchor="end">{_number(top)}</text>',
        f'<text x="{PAD_LEFT - 4}" y="{PAD_TOP + plot_h}" text-anchor="end">0</text>',
        f'<text x="{PAD_LEFT}" y="{HEIGHT - 4}">-{escape(_ago(window.span))}</text>',
        f'<text x="{WIDTH - 4}" y="{HEIGHT - 4}" text-anchor="end">now</text>',
    ]
    if kind == "bars":
        base = [0.0] * count
        for name, values in series.items():
            colour = COLOURS.get(name, COLOURS["rate"])
            for i, value in enumerate(values):
                if value <= 0:
                    continue
                h = value * scale
                y = PAD_TOP + plot_h - base[i] - h
                parts.append(
                    f'<rect x="{PAD_LEFT + i * slot:.1f}" y="{y:.1f}" '
                    f'width="{max(slot - 1, 1):.1f}"'
                    f' height="{h:.1f}" fill="{colour}"><title>{escape(name)}: '
                    f"{_number(value)} {escape(unit)}</title></rect>"
                )
                base[i] += h
    else:
        for name, values in series.items():
            colour = COLOURS.get(name, COLOURS["backlog"])
            points = " ".join(
                f"{PAD_LEFT + (i + 0.5) * slot:.1f},{PAD_TOP + plot_h - v * scale:.1f}"
                for i, v in enumerate(values)
            )
            parts.append(
                f'<polyline points="{points}" fill="none" stroke="{colour}" stroke-width="2">'
                f"<title>{escape(name)}</title></polyline>"
            )
    parts.append("</svg>")
    legend = " · ".join(f'<span class="{escape(name)}">■ {escape(name)}</span>' for name in series)
    return (
        f"<figure><figcaption>{escape(title)} <span class=note>({escape(unit)}, "
        f"last {escape(window.name)})</span></figcaption>{''.join(parts)}"
        f"<div class=note>{legend}</div></figure>"
    )


def _ago(span: timedelta) -> str:
    hours = span / timedelta(hours=1)
    return f"{hours:.0f}h" if hours >= 1 else f"{span / timedelta(minutes=1):.0f}m"
