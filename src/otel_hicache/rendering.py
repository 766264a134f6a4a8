"""How ``otel-hicache demo`` shows its summary: plain-text tables a person reads at a glance, or JSON.

Computing the summary lives in :mod:`otel_hicache.summary`; running the demo and the command's flags in
:mod:`otel_hicache.cli`. This module only turns a computed summary into text.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from otel_hicache import semconv as sc
from otel_hicache.summary import SizeDecision, size_decisions

if TYPE_CHECKING:
    from otel_hicache.cache.demo import DemoResult
    from otel_hicache.sdk import TelemetrySetup
    from otel_hicache.summary import Delivery, Summary


def render(summary: Summary, result: DemoResult, setup: TelemetrySetup) -> str:
    """The summary as plain-text tables a person can read at a glance."""
    out = [
        f"otel-hicache demo: {_n(result.requests)} requests in {result.wall_time_s:.1f} s on {result.device}, "
        f"{result.write_policy}"
    ]
    if summary.delivery is not None:
        out.append(_delivery(summary.delivery))
    elif setup.mode == "otlp":  # exporters in this process (beside a scrape endpoint): their log says what failed
        out.append(
            f"Sent over OTLP to {setup.endpoint or 'the default endpoint'} by this process's exporters (delivery is "
            "not counted here: their log lines say what failed); counters below are this process's exact totals."
        )

    total = summary.prefill_total
    out += ["", f"Prefix hits (share of {_n(total)} prefill tokens)"]
    rates = summary.hit_rates
    for tier, mode in (("device", "device_hit"), ("host", "host_hit"), ("storage", "storage_hit")):
        out.append(f"  {tier:<9}{_pct(rates[tier]):>8}  {_n(summary.prefill_tokens.get(mode, 0)):>14} tokens")
    computed = summary.prefill_tokens.get("input", 0)
    out.append(f"  {'computed':<9}{_pct(computed / total if total else None):>8}  {_n(computed):>14} tokens")

    out += ["", "Transfers by operation"]
    rows: list[tuple[str, ...]] = [("operation", "tokens", "bytes", "timed", "copy time", "bandwidth", "p50", "p99")]
    for operation in sc.TransferOperation:
        tokens = sum(v for (o, _), v in summary.tokens.items() if o == operation.value)
        nbytes = summary.bytes_by_operation.get(operation.value, 0)
        d = summary.durations.get(operation.value)
        bw = summary.bandwidth_bytes_per_s.get(operation.value)
        rows.append(
            (
                operation.value,
                _n(tokens),
                _bytes(nbytes),
                _n(d.count) if d else "-",
                _secs(d.total_s) if d else "-",
                f"{_bytes(bw)}/s" if bw is not None else "-",
                _secs(d.p50_s) if d else "-",
                _secs(d.p99_s) if d else "-",
            )
        )
    out += _table(rows)
    sources = sorted({d.source for d in summary.durations.values()})
    if sources:
        timing = sorted({t for d in summary.durations.values() for t in d.timing_sources})
        out.append(
            f"  (bandwidth = bytes / sum of copy durations, timed by {', '.join(timing)}; "
            f"percentiles from {' and '.join(sources)})"
        )

    keys = sorted({k for k, v in summary.tokens.items() if v} | set(summary.bytes_by_pool))
    if keys:
        out += ["", "Tokens and bytes by operation and pool (sidecar pools move bytes on another pool's tokens)"]
        rows = [("operation", "pool", "tokens", "bytes")]
        for op, pool in keys:
            split = summary.bytes_by_pool.get((op, pool))
            tokens = summary.tokens.get((op, pool), 0)
            rows.append((op, pool, _n(tokens), _bytes(split) if split is not None else "(total only)"))
        out += _table(rows)

    out += ["", f"Drops (device KV lost without a host copy): {_n(summary.dropped_total)} tokens"]
    for (reason, pool), n in sorted(summary.drops.items()):
        if n:
            out.append(f"  {reason:<34}{pool:<10}{_n(n):>12} tokens")
    failures = {k: v for k, v in summary.failures.items() if v}
    if failures:
        out.append("Failed transfers")
        for (op, error), n in sorted(failures.items()):
            out.append(f"  {op:<18}{error:<24}{_n(n):>8}")
    evictions = ", ".join(f"{tier} {_n(n)} tokens" for tier, n in sorted(summary.evictions.items()))
    out.append(f"Evictions: {evictions or 'none'}")
    out += _answers(summary)
    out += _what_if(result)
    out += _decisions(size_decisions(summary, result.capacity, result.wall_time_s))

    if summary.pools:
        out += ["", "Pool usage at the end"]
        rows = [("tier", "pool", "used", "limit", "used %")]
        for p in summary.pools:
            rows.append((p.tier, p.pool, _n(p.used), _n(p.limit), _pct(p.fraction_used)))
        out += _table(rows)

    pipe = summary.pipeline
    spans = "" if summary.delivery is not None else f"{_n(summary.spans_recorded)} spans recorded, "  # or on top
    out += [
        "",
        f"Telemetry: {spans}{_n(pipe['rejected'])} records rejected, {_n(pipe['normalized'])} normalized, "
        f"{_n(pipe['dropped_spans'])} records dropped (queue full or not exported)",
    ]
    if setup.prometheus_address is not None:
        host, port = setup.prometheus_address
        out.append(f"Prometheus scrape endpoint: http://{host}:{port}/metrics")
    out += [f"Note: {note}" for note in summary.notes]
    return "\n".join(out)


def _delivery(sent: Delivery) -> str:
    """The first thing a reader of an OTLP run needs: did the collector get the data. Never "exported" for what was
    not: delivered is what the collector took."""
    where = f"the collector at {sent.endpoint}" if sent.endpoint else "the collector (the default OTLP endpoint)"
    own = "Counters below are this process's own totals, not what the collector has."
    if not sent.exported and not sent.complete:
        return (
            f"OTLP: nothing delivered yet: {where} took no span in the {sent.waited_s:g} s this summary waited "
            f"({_n(sent.dropped)} dropped so far): is it running and reachable? {own}"
        )
    if not sent.exported and sent.dropped:
        return (
            f"OTLP: nothing delivered: {where} took none of {_n(sent.dropped)} spans, all dropped: is it running and "
            f"reachable? {own}"
        )
    pending = "" if sent.complete else f" More were still in flight after the {sent.waited_s:g} s this summary waited."
    return (
        f"OTLP to {where}: {_n(sent.exported)} spans delivered, {_n(sent.dropped)} dropped ({_n(sent.failed)} not "
        f"taken, {_n(sent.shed)} shed with the queue full); counters below are this process's exact totals.{pending}"
    )


def _answers(summary: Summary) -> list[str]:
    """Which tier served requests and how long they waited, whether each tier is the right size, what movement was
    wasted, and whether loading beats recomputing."""
    out = ["", "KV wait per request (prefills that waited for KV from a tier; p50 / p99 from histogram buckets)"]
    rows: list[tuple[str, ...]] = [("tier", "requests", "p50", "p99")]
    for tier in (sc.Tier.HOST.value, sc.Tier.STORAGE.value):
        w = summary.kv_waits.get(tier)
        rows.append((tier, _n(w.count), _secs(w.p50_s), _secs(w.p99_s)) if w else (tier, "0", "-", "-"))
    out += _table(rows)

    out += ["", "Is each tier the right size (evicted tokens never reused there; idle time of evicted entries)"]
    rows = [("tier", "evicted", "never reused", "idle p50", "idle p99")]
    for tier, t in summary.tier_sizing.items():
        rows.append(
            (
                tier,
                f"{_n(t.evicted_tokens)} tokens",
                _pct(t.never_reused_share),
                _secs(t.age.p50_s) if t.age else "-",
                _secs(t.age.p99_s) if t.age else "-",
            )
        )
    out += _table(rows) if len(rows) > 1 else ["  nothing evicted"]

    out += ["", "Wasted movement (bytes written to a tier, then evicted without being read back)"]
    rows = [("operation", "wasted", "written", "share")]
    for op, wasted in sorted(summary.wasted_bytes.items()):
        written = summary.bytes_by_operation.get(op, 0)
        rows.append((op, _bytes(wasted), _bytes(written), _pct(summary.wasted_shares.get(op))))
    out += _table(rows)
    out.append("  (the demo's L3 file store never evicts: nothing stored there is counted as wasted)")

    recompute = summary.prefill_seconds_per_token
    out += ["", "Load vs recompute (copy seconds per token; a storage hit pays storage_prefetch, then load_back)"]
    for op, seconds in sorted(summary.load_seconds_per_token.items()):
        line = f"  {op:<18}{_secs(seconds):>10}/token"
        ratio = summary.load_vs_recompute.get(op)
        if recompute is not None and ratio is not None:
            verdict = "faster" if ratio < 1 else "slower"
            line += f"  vs recompute {_secs(recompute)}/token: {ratio:.2g}x the time, loading is {verdict}"
        out.append(line)
    if not summary.load_seconds_per_token:
        out.append("  no timed loads")
    if recompute is None:
        out.append(
            "  recompute cost: needs the engine's prefill timing; the demo has no model "
            "(give --prefill-seconds-per-token)"
        )
    return out


def jsonable(summary: Summary, result: DemoResult, setup: TelemetrySetup) -> dict[str, Any]:
    def keyed(mapping: dict[Any, Any]) -> dict[str, Any]:
        return {"/".join(map(str, k)) if isinstance(k, tuple) else str(k): v for k, v in mapping.items()}

    def plain(v: Any) -> Any:
        return dataclasses.asdict(v) if dataclasses.is_dataclass(v) and not isinstance(v, type) else v

    body: dict[str, Any] = {}
    for f in dataclasses.fields(summary):
        value = getattr(summary, f.name)
        if isinstance(value, dict):
            value = keyed({k: plain(v) for k, v in value.items()})
        elif isinstance(value, list):
            value = [plain(v) for v in value]
        body[f.name] = plain(value)
    body["hit_rates"] = summary.hit_rates
    body["capacity"] = result.capacity  # hicache.capacity.hit_ratio: tier -> tokens, predicted share by factor
    body["size_decisions"] = [
        dataclasses.asdict(d) for d in size_decisions(summary, result.capacity, result.wall_time_s)
    ]
    body["elapsed_s"] = result.wall_time_s
    body["mode"] = setup.mode
    body["result"] = dataclasses.asdict(result)
    return body


def _what_if(result: DemoResult) -> list[str]:
    """Each tier's predicted share of prompt tokens (served by it or a faster tier) at other sizes, beside what it
    served: the model's error at 1x, the ceiling and the capacity misses."""
    if not result.capacity:
        return []
    out = ["", "What if each tier were bigger or smaller (share of prompt tokens served by the tier or a faster one)"]
    rows: list[tuple[str, ...]] = [("tier", "tokens", "observed", *(f"{f}x" for f in sc.CAPACITY_FACTORS[:-1]))]
    rows[0] += ("ceiling", "error at 1x")
    for tier, curve in result.capacity.items():
        ratios, observed = curve["hit_ratio"], result.served_shares.get(tier)
        error = f"{(ratios['1'] - observed) * 100:+.1f} pt" if observed is not None else "-"
        rows.append((tier, _n(curve["tokens"]), _pct(observed), *(_pct(ratios[f]) for f in sc.CAPACITY_FACTORS), error))
    out += _table(rows)
    out.append(
        "  (predicted from sampled reuse distances of the prefix lookups, the other tiers at today's size; ceiling: "
        "all but first-time tokens)"
    )
    return out


def _decisions(decisions: Sequence[SizeDecision]) -> list[str]:
    """The what-if in the operator's units: per tier and factor, the memory it takes and the prefill it saves."""
    if not decisions:
        return []
    known = all(d.prefill_seconds_per_s is not None for d in decisions)
    out = ["", "What each size would take and save (memory: all pools per kv token; prefill: this run's prompt rate)"]
    rows: list[tuple[str, ...]] = [("tier", "size", "memory", "prefill tokens/s", "prefill s/s" if known else "")]
    for d in decisions:
        memory = ("+" if d.memory_bytes > 0 else "-" if d.memory_bytes < 0 else "") + _bytes(abs(d.memory_bytes))
        seconds = f"{d.prefill_seconds_per_s:+.4f}" if d.prefill_seconds_per_s is not None else ""
        rows.append((d.tier, f"{d.factor}x", memory, f"{d.prefill_tokens_per_s:+,.0f}", seconds))
    out += _table(rows)
    if not known:
        out.append("  (prefill seconds: give --prefill-seconds-per-token, the engine's own cost of computing a token)")
    return out


def _table(rows: Sequence[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for row in rows:
        cells = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)]
        lines.append("  " + "  ".join(cells).rstrip())
    return lines


def _n(value: float) -> str:
    return f"{int(value):,}"


def _pct(fraction: float | None) -> str:
    return "-" if fraction is None else f"{100 * fraction:.1f}%"


def _bytes(value: float | None) -> str:
    if value is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def _secs(value: float | None) -> str:
    if value is None:
        return "-"
    if value >= 1:
        return f"{value:.2f} s"
    if value >= 1e-3:
        return f"{value * 1e3:.2f} ms"
    if value >= 1e-6:
        return f"{value * 1e6:.0f} us"
    return f"{value * 1e9:.0f} ns"
