"""The checks of the key itself: required, bounded, visible ASCII, an RFC 8941 sf-string."""

from __future__ import annotations

import uuid
from collections.abc import Mapping

from pgonce.conformance.http_run import (
    DRAFT,
    STRIPE,
    HttpRun,
    refused,
    suite,
)
from pgonce.conformance.report import Finding
from pgonce.conformance.runner import answered, shown
from pgonce.extras import needs

with needs("http", "pgonce conformance"):
    pass


@suite.check(
    "key-required",
    "a request without a key on an endpoint that requires one must not run unprotected",
    f"{DRAFT}, Error Scenarios (400)",
)
async def key_required(run: HttpRun) -> Finding:
    finding = Finding()
    if not run.target.key_required:
        return finding.skip("the endpoint does not require a key (--key-optional)")
    before = await run.count()
    refused(finding, await run.send(None), 400, "no key")
    await run.effects_since(before, 0, finding)
    return finding


async def refused_keys(run: HttpRun, keys: Mapping[str, str]) -> Finding:
    finding = Finding()
    before = await run.count()
    for what, value in keys.items():
        refused(finding, await run.send(value), 400, what)
    await run.effects_since(before, 0, finding)
    return finding


@suite.check(
    "key-empty",
    "an empty key names no operation: accepting it makes every such request one operation",
    f"{DRAFT}, Syntax (a non-empty sf-string) and Error Scenarios",
)
async def key_empty(run: HttpRun) -> Finding:
    return await refused_keys(run, {"an empty key": "", 'the sf-string ""': '""'})


@suite.check(
    "key-too-long",
    "keys over 255 characters are refused or kept whole, never truncated (two keys become one)",
    f"{STRIPE} (keys of up to 255 characters); {DRAFT} (no limit: a longer key is one key)",
)
async def key_too_long(run: HttpRun) -> Finding:
    finding = Finding()
    before = await run.count()
    stem = "k" * 255
    first = await run.send(f'"{stem}a"')
    if not first.is_success:
        refused(finding, first, 400, "a 256-character key")
        await run.effects_since(before, 0, finding)
        return finding
    # Accepted: another key with the same first 255 characters must be another operation.
    other = await run.send(f'"{stem}b"')
    finding.saw(f"a 256-character key: {shown(first)}; one differing in its last: {shown(other)}")
    finding.expect(other.is_success, answered("the second long key", other))
    same = other.content == first.content
    if same and before is None and not run.replayed(other):
        return finding.skip(
            "both long keys got the same answer; whether the second ran needs --count-url or "
            "--count-sql"
        )
    finding.expect(
        not (same and run.replayed(other)), "the second long key replayed the first: truncated"
    )
    await run.effects_since(before, 2, finding)
    return finding


@suite.check(
    "key-control-characters",
    "a key with control characters is not an sf-string and would corrupt logs and stores",
    f"{DRAFT}, Syntax; RFC 8941 §3.3.3 (sf-string: visible ASCII and space)",
)
async def key_control_characters(run: HttpRun) -> Finding:
    return await refused_keys(run, {"a key with a tab": '"conformance\tkey"'})


@suite.check(
    "key-structured-field",
    "the key is an RFC 8941 sf-string: escapes are decoded, a broken string is refused",
    f"{DRAFT}, Syntax; RFC 8941 §3.3.3",
)
async def key_structured_field(run: HttpRun) -> Finding:
    finding = Finding()
    before = await run.count()
    escaped = f'"conformance-\\"{uuid.uuid4().hex}\\""'
    first = await run.send(escaped)
    second = await run.send(escaped)
    finding.saw(f"escaped sf-string: {shown(first)}, retry {shown(second)}")
    finding.expect(first.is_success, answered("a key with sf-string escapes", first))
    finding.expect(
        second.content == first.content, "the retry with the escaped key was not a replay"
    )
    for what, value in {
        "an unterminated sf-string": '"conformance-open',
        "an sf-string with a bad escape": '"conformance\\x"',
    }.items():
        refused(finding, await run.send(value), 400, what)
    await run.effects_since(before, 1, finding)
    return finding
