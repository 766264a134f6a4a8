"""Validation: a producer's record in, plain checked values out, or :class:`Rejected`.

Every field is read exactly once (a mapping is iterated once into a list), so a record whose mappings change
between reads, raise half-way or call back into the telemetry is refused whole or counted whole, never half.
Integer-like scalars (numpy, torch) become ``int`` here, once; durations become ``float``. Nothing here takes a
lock or touches the OTel SDK, so a re-entrant record cannot deadlock anything.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple, TypeVar

from opentelemetry.trace import SpanContext

from otel_hicache import semconv as sc
from otel_hicache._internal.shared.channel import MAX_LABEL_BYTES, Link, Transfer
from otel_hicache.records import (
    DropRecord,
    EvictedEntry,
    EvictionRecord,
    KvWait,
    PoolUsage,
    PrefixSplit,
    TransferFailure,
    TransferRecord,
)
from otel_hicache.semconv import DropReason, PrefillMode, Problem, Tier, TimingSource, TransferOperation

#: Anything above these is a corrupted record, not a transfer (2**40 tokens, 1 PiB, one day).
MAX_TOKENS = 1 << 40
MAX_BYTES = 1 << 50
MAX_DURATION_S = 86_400.0
#: The oldest an evicted entry may have been idle (a year): older is a clock mix-up, not an age.
MAX_AGE_S = 365 * 86_400.0

OPERATIONS: dict[str, TransferOperation] = {op.value: op for op in TransferOperation}
REASONS: dict[str, DropReason] = {r.value: r for r in DropReason}
TIERS: dict[str, Tier] = {t.value: t for t in Tier}
TIMING_SOURCES: dict[str, TimingSource] = {t.value: t for t in TimingSource}
_ERRORS: dict[str, str] = {e: e for e in sc.TRANSFER_ERRORS}
#: The largest timestamp a record may carry (epoch nanoseconds as int64).
MAX_TIME_NS = (1 << 63) - 1


_Member = TypeVar("_Member")

#: The known pool names, each mapped to itself: lookups return our own string object.
Pools = Mapping[str, str]


class Rejected(Exception):
    """The record is refused; ``problem`` is the closed name counted in ``otel_hicache.records.rejected``."""

    def __init__(self, problem: Problem) -> None:
        super().__init__(problem.value)
        self.problem = problem


_new_transfer = tuple.__new__  # a Transfer made in C: a NamedTuple's own __new__ is one more Python frame


def count(value: Any, limit: int = MAX_TOKENS) -> int:
    """A sane non-negative integer as ``int`` (numpy and torch integers included), else :class:`Rejected`."""
    if type(value) is not int:
        if isinstance(value, bool) or value is None:
            raise Rejected(Problem.BAD_COUNT)
        try:
            value = operator.index(value)
        except Exception:
            raise Rejected(Problem.BAD_COUNT) from None
    if value < 0:
        raise Rejected(Problem.NEGATIVE_COUNT)
    if value > limit:
        raise Rejected(Problem.ABSURD_COUNT)
    return int(value)


def duration(value: Any, limit: float = MAX_DURATION_S) -> float:
    """A duration in seconds as ``float`` in ``[0, limit]``; strings, bools and NaN are refused."""
    if type(value) is not float:
        if value is None or isinstance(value, (bool, str, bytes)):
            raise Rejected(Problem.BAD_DURATION)
        try:
            value = float(value)
        except Exception:
            raise Rejected(Problem.BAD_DURATION) from None
    if not 0.0 <= value <= limit:  # also NaN
        raise Rejected(Problem.BAD_DURATION)
    return value


def _items(mapping: Any) -> list[tuple[Any, Any]]:
    """The one read of a producer's mapping."""
    if not isinstance(mapping, Mapping):
        raise Rejected(Problem.MALFORMED)
    try:
        return list(mapping.items())
    except Exception:
        raise Rejected(Problem.MALFORMED) from None


def pool_name(pool: Any, known: Pools, corrections: list[Problem]) -> str:
    """The known pool's own name (a plain ``str``: never the producer's object, whatever its ``__str__`` says), else
    ``other`` (noted once in ``corrections``)."""
    try:
        name = known.get(pool)
    except TypeError:  # unhashable
        name = None
    if name is not None:
        return name
    if Problem.UNKNOWN_POOL not in corrections:
        corrections.append(Problem.UNKNOWN_POOL)
    return sc.OTHER_POOL


def pool_counts(mapping: Any, known: Pools, limit: int, corrections: list[Problem]) -> list[tuple[str, int]]:
    """``(pool, count)`` pairs from one read of ``mapping``; unknown pools summed under ``other``."""
    if type(mapping) is dict:  # the common case, checked without copying: unique keys, plain ints, known pools
        items = list(mapping.items())
        for pool, n in items:
            if type(n) is not int or not 0 <= n <= limit or type(pool) is not str or pool not in known:
                break
        else:
            return items
    else:
        items = _items(mapping)
    out: dict[str, int] = {}
    for pool, n in items:
        n = count(n, limit)
        name = pool_name(pool, known, corrections)
        out[name] = out.get(name, 0) + n
    return list(out.items())


def _label(value: Any, corrections: list[Problem]) -> str | None:
    if value is None or (type(value) is str and len(value) <= MAX_LABEL_BYTES):
        return value
    if isinstance(value, str):
        return str(value)[:MAX_LABEL_BYTES]
    corrections.append(Problem.BAD_ATTRIBUTE)
    return None


def link(candidate: Any) -> Link | None:
    """A span context read once into plain values, or None: a valid one whose ids fit W3C's 128 and 64 bits (what
    a link on the wire can carry). Nothing of the producer's object is touched after this."""
    if not isinstance(candidate, SpanContext):
        return None
    try:
        trace_id, span_id = candidate.trace_id, candidate.span_id
        if type(trace_id) is not int or type(span_id) is not int:
            return None
        if not (0 < trace_id < 1 << 128 and 0 < span_id < 1 << 64):
            return None
        return Link(trace_id, span_id, int(candidate.trace_flags) & 0xFF, bool(candidate.is_remote))
    except Exception:
        return None


def _links(value: Any, corrections: list[Problem]) -> tuple[Link, ...]:
    if not value:
        return ()
    try:
        candidates = list(value)
    except Exception:
        corrections.append(Problem.BAD_LINK)
        return ()
    links = tuple(link for link in map(link, candidates) if link is not None)
    if len(links) != len(candidates):
        corrections.append(Problem.BAD_LINK)
    if len(links) > sc.MAX_LINKS:
        corrections.append(Problem.LINKS_TRUNCATED)
        links = links[: sc.MAX_LINKS]
    return links


class Site(NamedTuple):
    """What every transfer reported from one place of a producer shares (an SGLang ack queue: its operation, write
    policy and io backend), checked once by :func:`site`; each transfer then has only its own values checked
    (:func:`transfer_at`)."""

    operation: TransferOperation
    timing_source: TimingSource  # how the site's copy durations are measured (a transfer without one: NONE)
    write_policy: str | None
    io_backend: str | None
    corrections: tuple[Problem, ...]  # a label left out (not a string): counted with each transfer


#: What :func:`site` may note about a site's labels.
_SITE_CORRECTIONS = frozenset({Problem.BAD_ATTRIBUTE})


def site(operation: Any, timing_source: Any, write_policy: Any, io_backend: Any) -> Site:
    """Check what a site's transfers share (:class:`Rejected` for an unknown operation or timing source)."""
    corrections: list[Problem] = []
    return Site(
        _member(OPERATIONS, operation, Problem.UNKNOWN_OPERATION),
        _member(TIMING_SOURCES, timing_source, Problem.UNKNOWN_TIMING_SOURCE),
        _label(write_policy, corrections),
        _label(io_backend, corrections),
        tuple(corrections),
    )


def transfer(record: Any, known: Pools) -> Transfer:
    """Check a :class:`~otel_hicache.records.TransferRecord` (or anything shaped like one)."""
    if not isinstance(record, TransferRecord):
        raise Rejected(Problem.MALFORMED)
    (
        operation,
        tokens_by_pool,
        num_bytes,
        submit,
        complete,
        copy_s,
        source,
        merged,
        nodes,
        bytes_by_pool,
        policy,
        backend,
        links,
    ) = record
    op = _member(OPERATIONS, operation, Problem.UNKNOWN_OPERATION)
    timing = _member(TIMING_SOURCES, source, Problem.UNKNOWN_TIMING_SOURCE)
    corrections: list[Problem] = []
    policy, backend = _label(policy, corrections), _label(backend, corrections)
    return _transfer(
        operation=op,
        timing_source=timing,
        write_policy=policy,
        io_backend=backend,
        corrections=corrections,
        known=known,
        tokens_by_pool=tokens_by_pool,
        num_bytes=num_bytes,
        bytes_by_pool=bytes_by_pool,
        submit_time_ns=submit,
        complete_time_ns=complete,
        copy_duration_s=copy_s,
        merged_ops=merged,
        node_count=nodes,
        links=links,
    )


def transfer_at(
    at: Site,
    known: Pools,
    tokens_by_pool: Any,
    num_bytes: Any,
    submit: Any,
    complete: Any,
    copy_s: Any,
    merged: Any,
    nodes: Any,
    links: Any,
) -> Transfer:
    """Check one transfer of a checked :class:`Site`: no record object, and the site's values are not checked
    again, only that they are what :func:`site` makes (an adapter's hottest path)."""
    if at is not _last_site[0]:
        _check_site(at)
        _last_site[0] = at
    op, timing, policy, backend, corrections = at
    return _transfer(
        operation=op,
        timing_source=timing,
        write_policy=policy,
        io_backend=backend,
        corrections=list(corrections),
        known=known,
        tokens_by_pool=tokens_by_pool,
        num_bytes=num_bytes,
        submit_time_ns=submit,
        complete_time_ns=complete,
        copy_duration_s=copy_s,
        merged_ops=merged,
        node_count=nodes,
        links=links,
    )


#: The last site found to be what :func:`site` makes. A ``Site`` (exactly) holds only immutable values, so it stays
#: one: an adapter's transfers, mostly of one site in a row, skip the check by identity.
_last_site: list[Site | None] = [None]


def _check_site(at: Any) -> None:
    """Refuse a site :func:`site` could not have made: none of its objects may reach the counters or the ring (read
    under the telemetry's lock), where a label's ``__hash__`` could run code."""
    if type(at) is not Site:
        raise Rejected(Problem.MALFORMED)
    op, timing, policy, backend, corrections = at
    if (
        type(op) is not TransferOperation
        or type(timing) is not TimingSource
        or (policy is not None and (type(policy) is not str or len(policy) > MAX_LABEL_BYTES))
        or (backend is not None and (type(backend) is not str or len(backend) > MAX_LABEL_BYTES))
        or type(corrections) is not tuple
        or not _SITE_CORRECTIONS.issuperset(corrections)
    ):
        raise Rejected(Problem.MALFORMED)


def _member(table: Mapping[str, _Member], value: Any, problem: Problem) -> _Member:
    """``table``'s member for ``value`` (one of our own enum members, never the producer's object), else
    :class:`Rejected`."""
    try:
        member = table.get(value)
    except TypeError:  # unhashable
        member = None
    if member is None:
        raise Rejected(problem)
    return member


def _transfer(
    *,
    operation: TransferOperation,
    timing_source: TimingSource,
    write_policy: str | None,
    io_backend: str | None,
    corrections: list[Problem],
    known: Pools,
    tokens_by_pool: Any,
    num_bytes: Any,
    bytes_by_pool: Any = None,
    submit_time_ns: Any,
    complete_time_ns: Any,
    copy_duration_s: Any,
    merged_ops: Any,
    node_count: Any,
    links: Any,
) -> Transfer:
    """The checks of a transfer's own values, inline for the plain case: this runs for every transfer. The checked
    values (``operation`` to ``known``) are taken as they are; the rest are the producer's, checked here."""
    op, timing, policy, backend = operation, timing_source, write_policy, io_backend
    submit, complete, copy_s = submit_time_ns, complete_time_ns, copy_duration_s
    merged, nodes = merged_ops, node_count
    tokens = pool_counts(tokens_by_pool, known, MAX_TOKENS, corrections)
    total_bytes = num_bytes if type(num_bytes) is int and 0 <= num_bytes <= MAX_BYTES else count(num_bytes, MAX_BYTES)
    pool_bytes = None
    if bytes_by_pool is not None:
        pool_bytes = pool_counts(bytes_by_pool, known, MAX_BYTES, corrections)
        if sum(n for _, n in pool_bytes) != total_bytes:
            raise Rejected(Problem.BYTES_MISMATCH)
    start = submit if type(submit) is int and 0 <= submit <= MAX_TIME_NS else count(submit, MAX_TIME_NS)
    end = complete if type(complete) is int and start <= complete <= MAX_TIME_NS else count(complete, MAX_TIME_NS)
    if end < start:
        raise Rejected(Problem.END_BEFORE_START)
    seconds = None
    if copy_s is None:
        timing = TimingSource.NONE
    else:
        seconds = copy_s if type(copy_s) is float and 0.0 <= copy_s <= MAX_DURATION_S else duration(copy_s)
        if timing is TimingSource.NONE:  # a duration must say how it was measured
            raise Rejected(Problem.UNKNOWN_TIMING_SOURCE)
    return _new_transfer(
        Transfer,
        (
            op,
            tokens,
            total_bytes,
            pool_bytes,
            start,
            end,
            seconds,
            timing,
            merged if type(merged) is int and 0 <= merged <= MAX_TOKENS else count(merged),
            nodes if type(nodes) is int and 0 <= nodes <= MAX_TOKENS else count(nodes),
            policy,
            backend,
            _links(links, corrections) if links else (),
            tuple(corrections),
        ),
    )


class Failure(NamedTuple):
    """A checked :class:`~otel_hicache.records.TransferFailure`: its series of ``hicache.transfer.failures``."""

    operation: TransferOperation
    error_type: str  # one of semconv.TRANSFER_ERRORS, or OTHER_ERROR


def failure(record: Any) -> Failure:
    """The operation and ``error.type`` of a :class:`~otel_hicache.records.TransferFailure`."""
    if not isinstance(record, TransferFailure):
        raise Rejected(Problem.MALFORMED)
    op = OPERATIONS.get(record.operation) if isinstance(record.operation, str) else None
    if op is None:
        raise Rejected(Problem.UNKNOWN_OPERATION)
    return Failure(op, _ERRORS.get(record.error_type, sc.OTHER_ERROR))  # our own name, never the producer's object


class Drop(NamedTuple):
    """A checked :class:`~otel_hicache.records.DropRecord`."""

    reason: DropReason
    tokens: list[tuple[str, int]]  # (pool, tokens), pools unique


def drop(record: Any, known: Pools, corrections: list[Problem]) -> Drop:
    """The reason and tokens per pool; a reason we do not know is counted as ``other`` (noted in ``corrections``)."""
    if not isinstance(record, DropRecord):
        raise Rejected(Problem.MALFORMED)
    try:
        reason = REASONS.get(record.reason)
    except TypeError:  # unhashable
        reason = None
    if reason is None:
        corrections.append(Problem.UNKNOWN_REASON)
        reason = DropReason.OTHER
    return Drop(reason, pool_counts(record.tokens_by_pool, known, MAX_TOKENS, corrections))


class Eviction(NamedTuple):
    """A checked eviction pass, its entries summed up: what the counters and histograms need, nothing per entry."""

    tier: Tier
    tokens: int
    duration_s: float
    time_ns: int
    tokens_by_reuse: dict[bool | None, int]  # None: unknown (the pass's tokens no entry accounts for included)
    unread_bytes: dict[TransferOperation, int]  # bytes evicted unread, by the operation that wrote them
    ages: list[float]  # the entries' idle times, where known


#: What wrote the bytes of an entry evicted from a tier, when the producer does not say.
WRITTEN_BY: dict[Tier, TransferOperation] = {
    Tier.HOST: TransferOperation.BACKUP,
    Tier.STORAGE: TransferOperation.STORAGE_BACKUP,
    Tier.DEVICE: TransferOperation.LOAD_BACK,
}


def eviction(record: Any) -> Eviction:
    """A checked :class:`~otel_hicache.records.EvictionRecord`, its entries read once and summed up. At most
    :data:`~otel_hicache.semconv.MAX_EVICTION_ENTRIES` entries (more: ``too_many_entries``), each checked inline in
    the plain case (ints, a float or None, a bool or None), so the largest pass costs its caller well under 1 ms."""
    if not isinstance(record, EvictionRecord):
        raise Rejected(Problem.MALFORMED)
    tier = _member(TIERS, record.tier, Problem.UNKNOWN_TIER)
    tokens = count(record.num_tokens)
    written_by = WRITTEN_BY[tier]
    by_reuse: dict[bool | None, int] = {}
    unread_bytes: dict[TransferOperation, int] = {}
    ages: list[float] = []
    for entry in _entries(record.entries):
        if not isinstance(entry, EvictedEntry):
            raise Rejected(Problem.MALFORMED)
        n, idle_s, reused, unread, by = entry
        if type(n) is not int or not 0 <= n <= MAX_TOKENS:
            n = count(n)
        if idle_s is not None:
            ages.append(idle_s if type(idle_s) is float and 0.0 <= idle_s <= MAX_AGE_S else duration(idle_s, MAX_AGE_S))
        if reused is not None and type(reused) is not bool:
            reused = _flag(reused)
        by_reuse[reused] = by_reuse.get(reused, 0) + n
        op = written_by if by is None else _member(OPERATIONS, by, Problem.UNKNOWN_OPERATION)
        if type(unread) is not int or not 0 <= unread <= MAX_BYTES:
            unread = count(unread, MAX_BYTES)
        if unread:
            unread_bytes[op] = unread_bytes.get(op, 0) + unread
    unknown = tokens - sum(by_reuse.values())  # tokens of the pass no entry accounts for
    if unknown < 0:
        raise Rejected(Problem.ENTRIES_EXCEED_TOTAL)
    if unknown or not by_reuse:
        by_reuse[None] = by_reuse.get(None, 0) + unknown
    seconds = duration(record.duration_s)
    return Eviction(tier, tokens, seconds, count(record.time_ns, MAX_TIME_NS), by_reuse, unread_bytes, ages)


def _entries(value: Any) -> list[Any]:
    """The one read of a pass's entries: at most :data:`~otel_hicache.semconv.MAX_EVICTION_ENTRIES`."""
    if not value:
        return []
    if isinstance(value, (str, bytes, Mapping)):
        raise Rejected(Problem.MALFORMED)
    try:
        items = list(value)
    except Exception:
        raise Rejected(Problem.MALFORMED) from None
    if len(items) > sc.MAX_EVICTION_ENTRIES:
        raise Rejected(Problem.TOO_MANY_ENTRIES)
    return items


def _flag(value: Any) -> bool | None:
    """A boolean (numpy's included) or None."""
    if value is None or type(value) is bool:
        return value
    if type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_"):  # without importing numpy
        return bool(value)
    raise Rejected(Problem.MALFORMED)


class Wait(NamedTuple):
    """A checked :class:`~otel_hicache.records.KvWait`."""

    tier: Tier
    seconds: float
    time_ns: int


def kv_wait(record: Any) -> Wait:
    """A checked :class:`~otel_hicache.records.KvWait`; only host and storage serve KV."""
    if not isinstance(record, KvWait):
        raise Rejected(Problem.MALFORMED)
    tier = _member(TIERS, record.tier, Problem.UNKNOWN_TIER)
    if tier is Tier.DEVICE:
        raise Rejected(Problem.UNKNOWN_TIER)
    return Wait(tier, duration(record.wait_s), count(record.time_ns, MAX_TIME_NS))


def prefix_split(record: Any, other_hit: Any = 0) -> dict[PrefillMode, int]:
    """Tokens per mode; ``other`` only when ``other_hit`` (hits of a kind we do not know) has some."""
    if not isinstance(record, PrefixSplit):
        raise Rejected(Problem.MALFORMED)
    # plain ints in range taken as they are (the common case: one per prefill batch on the host thread)
    modes = {mode: n if type(n) is int and 0 <= n <= MAX_TOKENS else count(n) for mode, n in record.by_mode().items()}
    other = count(other_hit)
    if other:
        modes[PrefillMode.OTHER] = other
    return modes


#: The modes of a row ``(input, device hit, host hit, storage hit, other hit)``, in its order.
_ROW_MODES = (
    PrefillMode.INPUT,
    PrefillMode.DEVICE_HIT,
    PrefillMode.HOST_HIT,
    PrefillMode.STORAGE_HIT,
    PrefillMode.OTHER,
)


class PrefixRows(NamedTuple):
    """What :func:`prefix_rows` found."""

    sums: dict[PrefillMode, int]  # per mode, of the plain rows (modes with none left out)
    summed: int  # how many plain rows
    odd: list[Any]  # the other rows, as they are, to be checked one by one
    broken: bool  # the rows could not be read to their end (what was read is above)


def prefix_rows(rows: Iterable[Any]) -> PrefixRows:
    """The rows ``(input, device hit, host hit, storage hit, other hit)``: the sum of those that are five plain
    in-range ints (the common case: every prefill batch an engine counted since the host thread's last round), and the
    others apart. Never raises: an iterable that fails keeps what it yielded before."""
    sums = [0, 0, 0, 0, 0]
    summed = 0
    odd: list[Any] = []
    broken = False
    try:
        for row in rows:
            if type(row) is tuple and len(row) == 5 and all(type(n) is int and 0 <= n <= MAX_TOKENS for n in row):
                sums = [total + n for total, n in zip(sums, row, strict=True)]
                summed += 1
            else:
                odd.append(row)
    except Exception:
        broken = True
    return PrefixRows({m: total for m, total in zip(_ROW_MODES, sums, strict=True) if total}, summed, odd, broken)


def prefix_row(row: Any) -> tuple[PrefixSplit, Any]:
    """One row that is not plain, as a split and its other hits (checked by :func:`prefix_split`), else
    :class:`Rejected`: a tuple or list of five items, read by index (never unpacked: a row may lie about itself)."""
    if not isinstance(row, (tuple, list)) or len(row) != 5:
        raise Rejected(Problem.MALFORMED)
    return PrefixSplit(row[0], row[1], row[2], row[3]), row[4]


class Usage(NamedTuple):
    """A checked :class:`~otel_hicache.records.PoolUsage`."""

    tier: Tier
    pool: str
    used: int
    limit: int


def pool_usages(entries: Iterable[Any], known: Pools, corrections: list[Problem]) -> list[Usage]:
    """Each well-formed :class:`~otel_hicache.records.PoolUsage` of one reading of a source; a bad entry raises
    :class:`Rejected` for the whole reading."""
    out = []
    for usage in list(entries):
        if not isinstance(usage, PoolUsage):
            raise Rejected(Problem.MALFORMED)
        tier = TIERS.get(usage.tier) if isinstance(usage.tier, str) else None
        if tier is None:
            raise Rejected(Problem.UNKNOWN_TIER)
        pool = pool_name(usage.pool, known, corrections)
        used, limit = count(usage.used), count(usage.limit)
        if used > limit:
            raise Rejected(Problem.ABSURD_COUNT)
        out.append(Usage(tier, pool, used, limit))
    return out
