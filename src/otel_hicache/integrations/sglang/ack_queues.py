"""SGLang's ack queues, adopted: each merged transfer is noted where its ack enters a controller's queue and reported
where it leaves.

The first submission the hooks see on a controller (``start_writing`` / ``start_loading``) replaces its
``ack_write_queue`` / ``ack_load_queue`` by an :class:`AckQueue` (a ``list``, with the same acks), and the controller's
later submissions call SGLang's methods directly (:class:`~.._base.Skips`). From then on the queue itself does the
work, on the scheduler thread:

* **submission**: SGLang appends one ``HiCacheAck`` per merged transfer right after handing its copy to the transfer
  stream; ``append`` notes that time (whether instrumentation is suppressed there, too). Everything else is read from
  the ack once it is consumed: tokens per pool, bytes, the merged ops (one node id each), the copy time of its events;
* **consumption**: every consumer of SGLang 0.5.23 takes acks with ``pop(0)`` - ``writing_check`` (and ``clear()``
  under write-back), ``loading_check``, PD decode's ``DecodeKVCacheOffloadManager._check_offload_progress`` - so the
  checks themselves run unwrapped (a check that consumes nothing costs nothing), and each consumed ack costs one entry
  put on a :class:`~otel_hicache.telemetry.DeferredQueue` (two C calls). :class:`AckReporter` builds and counts the
  transfer on the telemetry's host thread.

Every other way a list can lose items (``del q[:n]``, ``q[:] = ...``, ``remove``, ``q *= 0``) reports the acks it
removed the same way, as consumed: SGLang removes only acks it consumed, except in ``HiCacheController.reset``
(wrapped: those are forgotten). An ack added other than by ``append`` has no submission time: its span starts when it
was consumed. A queue that is not a ``list`` (say, a ``collections.deque``) is left as it is, with one warning: its
acks are not reported, and the self-check counts the missing transfers. A queue object SGLang replaces takes its
unconsumed acks with it, unseen.

Nothing here synchronises a device: a copy duration is read from an ack's events only after SGLang consumed the ack
(its finish event is complete), through :func:`otel_hicache.timing.elapsed_seconds`, which checks ``query()`` first.
Failure rule (:mod:`.._base`): our code never raises into SGLang; a failure is logged once.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from time import monotonic_ns
from typing import Any, Final, SupportsIndex

from opentelemetry.trace import Span, SpanContext

from otel_hicache.integrations._base import MAX_PENDING, hook_failed, suppressed, trim
from otel_hicache.records import KvWait
from otel_hicache.semconv import Tier, TimingSource, TransferOperation
from otel_hicache.telemetry import DeferredQueue, HiCacheTelemetry
from otel_hicache.timing import ANCHOR, elapsed_seconds

ENGINE: Final = "SGLang HiCache"
#: The two directions: a controller's backups (``ack_write_queue``) and load backs (``ack_load_queue``).
WRITE: Final = "write"
LOAD: Final = "load"
QUEUE: Final = {WRITE: "ack_write_queue", LOAD: "ack_load_queue"}
#: What a transfer is known to serve: (when, in monotonic ns; the request span's context, None untraced; the request
#: span; the request's identity). Load backs: every request that started one (its KV wait); backups: traced ones only.
Link = tuple[int, "SpanContext | None", "Span | None", int]
#: ack id -> the links of the requests its next transfer serves
Links = dict[int, tuple[Link, ...]]
#: an ack whose submission was not seen (queued before its queue was adopted, or added other than by ``append``)
_UNSEEN: Final = -1


class AckQueue(list[Any]):  # SGLang's List[HiCacheAck]
    """A controller's ack queue as SGLang uses it (a ``list``; reading is untouched) that notes when each ack enters
    it and hands each ack leaving it to the telemetry's host thread: one entry put on a
    :class:`~otel_hicache.telemetry.DeferredQueue`, two C calls. Detached (uninstrumented): a plain list."""

    __slots__ = ("__weakref__", "_closer", "_deferred", "_submitted", "reporter")

    def __init__(self, acks: Iterable[Any]) -> None:
        super().__init__(acks)
        self.reporter: AckReporter | None = None
        self._deferred: DeferredQueue | None = None
        self._submitted: dict[int, int | None] | None = None
        self._closer: weakref.finalize[Any, Any] | None = None

    def attach(self, reporter: AckReporter, deferred: DeferredQueue) -> None:
        self.detach()
        self.reporter, self._deferred, self._submitted = reporter, deferred, reporter.submitted
        # a controller that goes away: its queue is dropped once drained
        self._closer = weakref.finalize(self, deferred.close)

    def detach(self) -> None:
        closer, self._closer, self._deferred, self._submitted, self.reporter = self._closer, None, None, None, None
        if closer is not None:
            closer()  # closes the deferred queue, and lets go of it (and of its reporter) once drained

    def append(self, ack: Any) -> None:
        """SGLang queues a merged transfer's ack right after submitting its copy: the transfer's submission time
        (None inside ``suppress_instrumentation()``: not reported)."""
        submitted = self._submitted
        if submitted is not None:
            try:
                submitted[id(ack)] = None if suppressed() else monotonic_ns()
                if len(submitted) > MAX_PENDING:
                    trim(submitted)
            except Exception:
                hook_failed(ENGINE, "ack queue")
        list.append(self, ack)

    def pop(self, index: SupportsIndex = -1) -> Any:
        ack = list.pop(self, index)
        deferred = self._deferred
        if deferred is not None:
            try:
                deferred.put((next(deferred.seq), ack, monotonic_ns()))
            except Exception:
                hook_failed(ENGINE, "ack queue")
        return ack

    def clear(self) -> None:
        acks = list(self) if self._deferred is not None else ()
        list.clear(self)
        self._left(acks)

    def remove(self, value: Any) -> None:
        try:
            index = list.index(self, value)
        except Exception:
            return list.remove(self, value)  # raises what a list raises
        ack = list.__getitem__(self, index)
        list.__delitem__(self, index)
        self._left((ack,))
        return None

    def __delitem__(self, index: SupportsIndex | slice) -> None:
        try:
            removed = list.__getitem__(self, index)
        except Exception:
            return list.__delitem__(self, index)  # raises what a list raises
        list.__delitem__(self, index)
        self._left(removed if isinstance(index, slice) else (removed,))
        return None

    def __setitem__(self, index: Any, value: Any) -> None:
        try:
            before = list.__getitem__(self, index)
        except Exception:
            return list.__setitem__(self, index, value)  # raises what a list raises
        list.__setitem__(self, index, value)
        if isinstance(index, slice):
            kept = {id(ack) for ack in self}
            self._left([ack for ack in before if id(ack) not in kept])
        elif before is not list.__getitem__(self, index):
            self._left((before,))
        return None

    def __imul__(self, times: SupportsIndex) -> AckQueue:
        before = list(self)
        list.__imul__(self, times)
        if not self:
            self._left(before)
        return self

    def _left(self, acks: Iterable[Any]) -> None:
        """``acks`` left the queue other than by ``pop``: consumed, or forgotten by ``HiCacheController.reset``."""
        deferred, reporter = self._deferred, self.reporter
        if deferred is None or reporter is None:
            return
        try:
            if reporter.forgetting:  # HiCacheController.reset: these acks were never consumed
                for ack in acks:
                    reporter.submitted.pop(id(ack), None)
                return
            done_ns = monotonic_ns()  # write-back's writing_check clears after synchronising every ack
            for ack in acks:
                deferred.put((next(deferred.seq), ack, done_ns))
        except Exception:
            hook_failed(ENGINE, "ack queue")


class AckReporter:
    """Reports one queue's consumed acks as transfers of one operation (``backup`` for the write queue, ``load_back``
    for the load queue), on the telemetry's host thread. ``sample``: called there once per ack (the eviction
    bookkeeping's access clock, sampled off the scheduler thread)."""

    __slots__ = ("forgetting", "links", "report", "sample", "site", "submitted", "waits")

    def __init__(
        self, telemetry: HiCacheTelemetry, cc: Any, direction: str, links: Links, sample: Callable[[], None]
    ) -> None:
        write = direction == WRITE
        self.site = telemetry.transfer_site(
            TransferOperation.BACKUP if write else TransferOperation.LOAD_BACK,
            timing_source=TimingSource.CUDA_EVENT,  # SGLang times its copies with device events, when it times them
            write_policy=cc.write_policy if write else None,
            io_backend=cc.io_backend or None,
        )
        self.report = telemetry.record_transfer_at
        self.waits = None if write else telemetry.record_kv_wait  # a load back: its requests waited for it
        self.links = links  # the requests this direction's transfers serve
        self.sample = sample
        #: id(ack) -> when it was submitted (monotonic ns); None: under suppression, not to be reported
        self.submitted: dict[int, int | None] = {}
        self.forgetting = False  # HiCacheController.reset is clearing the queue: its acks were never consumed

    def record(self, entry: tuple[int, Any, int]) -> None:
        """Report one consumed ack, ``(seq, ack, when it left)`` (host thread), unless it was submitted under
        suppression. No record object: the transfer's values go to the telemetry by name as they are."""
        _, ack, done_ns = entry
        submit_ns = self.submitted.pop(id(ack), _UNSEEN)  # the ack is alive in the payload: its id is its own
        if submit_ns is None:
            return  # submitted inside suppress_instrumentation(): not reported
        self.sample()
        nodes, epoch = ack.node_ids, ANCHOR.offset_ns  # monotonic -> epoch ns
        served = _served(self.links, nodes, done_ns) if self.links else ()
        self.report(
            self.site,
            tokens_by_pool=ack.num_tokens_by_pool or {},
            num_bytes=ack.num_bytes,  # one total across pools: SGLang does not split bytes by pool
            submit_time_ns=(done_ns if submit_ns == _UNSEEN else submit_ns) + epoch,
            complete_time_ns=done_ns + epoch,
            # the ack was consumed, so its finish event is complete: no sync here
            copy_duration_s=elapsed_seconds(ack.start_event, ack.finish_event) if ack.timing_enabled else None,
            merged_ops=len(nodes),  # SGLang merges CacheOperations of one node id each, concatenating the ids
            node_count=len(nodes),
            links=tuple(context for _, context, _, _ in served if context is not None),
        )
        waits, waited = self.waits, set()
        if waits is not None:
            for linked_ns, _, span, request in served:  # each request once: its nodes may be several of the ack's
                if request not in waited:
                    waited.add(request)
                    waits(KvWait(Tier.HOST, (done_ns - linked_ns) / 1e9, done_ns + epoch), span)


def _served(links: Links, ack_ids: list[int], done_ns: int) -> list[Link]:
    """The requests linked to ``ack_ids`` before their ack was consumed (``done_ns``), taken from ``links``.
    The record is built after consumption, so a link made since belongs to a later transfer of the same node and
    stays for it."""
    served: list[Link] = []
    for ack_id in ack_ids:
        entry = links.get(ack_id)
        if not entry:
            continue
        mine = [link for link in entry if link[0] <= done_ns]
        if len(mine) == len(entry):
            links.pop(ack_id, None)
        elif mine:
            links[ack_id] = tuple(link for link in entry if link[0] > done_ns)
        served += mine
    return served
