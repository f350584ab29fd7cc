"""Security checks: no cross-scope replay, the admin page's credential, constant-time comparisons,
and (at the end of the run) no secret and no traceback in any log or refusal the suite captured.
"""

from __future__ import annotations

import ast
import asyncio
import base64
import json
from collections import Counter
from pathlib import Path

import httpx
import psycopg

from faults.context import Context
from faults.load import Accounting
from faults.procs import ROOT
from faults.proxy import free_port
from faults.report import Result

#: Names that hold a secret, a signature, a MAC or a token: comparing one with == would leak
#: timing. The constant-time check flags any ==/!= whose operands mention one of them.
SENSITIVE = ("signature", "digest", "token", "secret", "password", "csrf", "mac", "expected")
#: Where pgonce verifies something secret.
VERIFIERS = ("src/pgonce/webhooks/schemes", "src/pgonce/service/admin.py", "src/pgonce/http")


def timing_unsafe_comparisons() -> tuple[list[str], int]:
    """``==``/``!=`` on secret-looking operands in the verifiers, and the count of
    ``hmac.compare_digest`` calls there."""
    found: list[str] = []
    digests = 0
    files: list[Path] = []
    for where in VERIFIERS:
        path = ROOT / where
        files += sorted(path.rglob("*.py")) if path.is_dir() else [path]
    for file in files:
        source = file.read_text()
        tree = ast.parse(source)
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and ast.unparse(node.func).endswith("compare_digest"):
                digests += 1
            if isinstance(node, ast.Compare) and any(
                isinstance(op, ast.Eq | ast.NotEq) for op in node.ops
            ):
                operands = [node.left, *node.comparators]
                # A comparison with a literal (a scheme name, a status, None), of lengths (public:
                # a signature's size is in the spec), or of a value with itself transformed
                # (``secret != secret.strip()``, a configuration check) leaks nothing.
                if any(isinstance(o, ast.Constant) for o in operands) or any(
                    isinstance(o, ast.Call) and ast.unparse(o.func) == "len" for o in operands
                ):
                    continue
                names = [{n.id for n in ast.walk(o) if isinstance(n, ast.Name)} for o in operands]
                if all(n == names[0] for n in names[1:]):
                    continue
                text = ast.unparse(node).lower()
                if any(word in text for word in SENSITIVE):
                    found.append(f"{file.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    return found, digests


async def cross_scope_and_admin(ctx: Context) -> Result:
    keys = ctx.size(50, 10)
    result = Result(
        "security: cross-scope replay, admin credential, constant time",
        f"{keys} Idempotency-Keys each sent by two principals at once (same key, same body), "
        "then retried by both; the admin page without, with a wrong and with the right "
        "credential; a source scan of the verifiers",
        "a second caller reusing another caller's key; requests without credentials",
    )
    dsn = ctx.database("security")
    port, service_port = free_port(), free_port()
    firsts: dict[tuple[str, int], bytes] = {}
    crossed = 0
    admin: dict[str, int] = {}
    with ctx.processes() as procs:
        procs.payments("security-payments", dsn, port)
        procs.service("security-service", dsn, service_port)
        ctx.keep_logs(procs)
        url = f"http://127.0.0.1:{port}/payments"
        async with httpx.AsyncClient(timeout=30) as client:

            async def pay(who: str, k: int) -> httpx.Response:
                return await client.post(
                    url,
                    json={"amount": 4_000_000 + k, "currency": "EUR"},
                    headers={"authorization": f"Bearer {who}-token",
                             "idempotency-key": f'"shared-{k}"'},
                )  # fmt: skip

            for k in range(keys):
                answers = await asyncio.gather(pay("alice", k), pay("bob", k))
                for who, answer in zip(("alice", "bob"), answers, strict=True):
                    if answer.status_code == 201:
                        firsts[(who, k)] = answer.content
                    result.acc.statuses[str(answer.status_code)] += 1
            for (who, k), first in firsts.items():
                again = await pay(who, k)
                result.acc.statuses[f"retry {again.status_code}"] += 1
                if again.content != first:
                    crossed += 1
            base = f"http://127.0.0.1:{service_port}"
            admin["no credential"] = (await client.get(f"{base}/admin")).status_code
            admin["wrong token"] = (
                await client.get(f"{base}/admin", auth=("admin", "not-the-token"))
            ).status_code
            nonascii = base64.b64encode("admin:mot-de-passe-é".encode()).decode()
            admin["non-ASCII password"] = (
                await client.get(f"{base}/admin", headers={"authorization": f"Basic {nonascii}"})
            ).status_code
            admin["not Basic"] = (
                await client.get(
                    f"{base}/admin", headers={"authorization": f"Bearer {ctx.secrets.admin}"}
                )
            ).status_code
            admin["events page, no credential"] = (
                await client.get(f"{base}/admin/events")
            ).status_code
            admin["replay without credential"] = (
                await client.post(f"{base}/admin/replay", data={"source": "shop", "id": "x"})
            ).status_code
            admin["replay with a forged CSRF token"] = (
                await client.post(
                    f"{base}/admin/replay",
                    auth=("admin", ctx.secrets.admin),
                    data={"source": "shop", "id": "x", "csrf": "guess"},
                )
            ).status_code
            admin["right token"] = (
                await client.get(f"{base}/admin", auth=("admin", ctx.secrets.admin))
            ).status_code
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT principal, amount, count(*) FROM payments GROUP BY principal, amount"
        ).fetchall()
    per = {(str(p), int(a) - 4_000_000): int(c) for p, a, c in rows}
    ids = {json.loads(body)["id"] for body in firsts.values()}
    result.acc = Accounting(
        sent=2 * keys,
        acknowledged=len(firsts),
        effects=len(per),
        lost=len(firsts.keys() - per.keys()),
        doubled=sum(c - 1 for c in per.values()),
        statuses=result.acc.statuses,
    )
    result.check(
        "the same key from two principals made two payments, each principal's retry replays "
        "its own answer (never the other's)",
        len(per) == 2 * keys and len(ids) == 2 * keys and crossed == 0,
    )
    refused = {k: v for k, v in admin.items() if k != "right token"}
    expected = {k: (403 if "CSRF" in k else 401) for k in refused}
    result.check(
        "the admin page refuses without its credential: "
        + ", ".join(f"{k} → {v}" for k, v in admin.items()),
        refused == expected and admin["right token"] == 200,
    )
    unsafe, digests = timing_unsafe_comparisons()
    found = (
        "no == on a secret, signature or token" if not unsafe else "== found: " + "; ".join(unsafe)
    )
    result.check(
        f"constant-time comparisons: {digests} hmac.compare_digest calls in the verifiers, {found}",
        not unsafe and digests > 0,
    )
    return result


def exceptions_logged(text: str) -> Counter[str]:
    """The exception line that ends each traceback in a log (what was raised, not where)."""
    found: Counter[str] = Counter()
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if not line.startswith("Traceback (most recent call last)"):
            continue
        for after in lines[i + 1 :]:
            if after and not after[0].isspace():
                found[after[:160]] += 1
                break
    return found


#: Each process the suite starts writes at least its start and stop lines; fewer in all means the
#: scan read the wrong place (or nothing), not that the run was clean.
MIN_LINES_PER_LOG = 2


def scan_secrets_and_tracebacks(ctx: Context) -> Result:
    """Every log the started processes wrote and every refusal body captured in the run."""
    return scan(sorted(ctx.logs), ctx.secrets.all(), ctx.bodies)


def scan(logs: list[Path], secrets: list[str], bodies: list[bytes]) -> Result:
    """Scan ``logs`` and ``bodies`` for ``secrets`` and ``logs`` for Python tracebacks.

    Fails (not merely finds nothing) when a log is missing or the logs hold fewer lines than
    their processes always write: a scan that read nothing proves nothing."""
    present = [p for p in logs if p.exists()]
    # Named with their folder: processes of the same role in two runs write logs of one name.
    text = {f"{p.parent.name}/{p.name}": p.read_bytes() for p in present}
    lines = sum(data.count(b"\n") for data in text.values())
    needles = [s.encode() for s in secrets]
    leaked_logs = sorted(name for name, data in text.items() if any(n in data for n in needles))
    leaked_bodies = sum(1 for body in bodies if any(n in body for n in needles))
    tracebacks = {name: data.count(b"Traceback") for name, data in text.items()}
    with_tracebacks = {k: v for k, v in tracebacks.items() if v}
    size = sum(len(d) for d in text.values())
    minimum = MIN_LINES_PER_LOG * len(logs)
    result = Result(
        "security: secrets and tracebacks in logs and answers",
        f"{len(present)} process logs ({lines} lines, {size / 1e6:.1f} MB) and {len(bodies)} "
        "refusal bodies captured during the whole run",
        "scan for the run's webhook secret (with and without its prefix) and admin token, and "
        "for Python tracebacks",
    )
    result.check(
        f"the scan read every process's log ({len(present)} of {len(logs)}) and at least "
        f"{minimum} lines ({lines})",
        len(present) == len(logs) > 0 and lines >= minimum,
    )
    result.check(
        "no secret in any log" + (f": found in {', '.join(leaked_logs)}" if leaked_logs else ""),
        not leaked_logs,
    )
    result.check(f"no secret in any refusal body ({leaked_bodies} with one)", leaked_bodies == 0)
    result.check(
        "no traceback in any log"
        + (
            ": " + ", ".join(f"{k} ({v})" for k, v in sorted(with_tracebacks.items()))
            if with_tracebacks
            else ""
        ),
        not with_tracebacks,
    )
    for name in sorted(with_tracebacks):
        raised = exceptions_logged(text[name].decode(errors="replace"))
        result.acc.notes += [f"{name}: {line} (×{n})" for line, n in raised.most_common(5)]
    return result
