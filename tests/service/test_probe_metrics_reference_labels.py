"""The metrics reference (``tools/docs_reference.py``) lists every label each family carries,
those of the families the relay's collector builds at scrape time included (the ``reason`` of
``pgonce_relay_failures_total`` was missing): each label of a scraped sample is in its row."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType

from prometheus_client.parser import text_string_to_metric_families

from pgonce.relay import RelayStats
from pgonce.service.metrics import ServiceMetrics

TOOL = Path(__file__).parents[2] / "tools" / "docs_reference.py"


def generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_reference", TOOL)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def reference_rows() -> dict[str, set[str]]:
    rows: dict[str, set[str]] = {}
    for line in generator().metrics_reference().splitlines()[2:]:
        name, _kind, labels = (cell.strip() for cell in line.split("|")[1:4])
        rows[name.strip("`")] = set(re.findall(r"`(\w+)`", labels))
    return rows


def test_every_scraped_label_is_in_the_reference() -> None:
    stats = RelayStats(published=1)
    stats.fail("nacked")
    metrics = ServiceMetrics(relay_stats=lambda: [stats])
    metrics.deliveries.labels("shop", "stored").inc()
    rows = reference_rows()
    seen: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        name = family.name + ("_total" if family.type == "counter" else "")
        for sample in family.samples:
            labels = set(sample.labels) - {"le"}  # a histogram's buckets
            seen.setdefault(name, set()).update(labels)
    assert seen["pgonce_relay_failures_total"] == {"reason"}
    for name, labels in seen.items():
        assert labels <= rows[name], (name, labels, rows[name])


def test_the_reference_describes_the_swept_outcome() -> None:
    rows = generator().metrics_reference()
    assert "swept: a 503" in rows
