"""Where an adapter's records go: one lazily built telemetry per process (:class:`ProcessSink`), the ranks it is built
with (:class:`Ranks`), the base of every group of wrappers (:class:`EngineHooks`), and bounded bookkeeping
(:func:`trim`, :class:`WeakPoolSource`)."""

from __future__ import annotations

import threading
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import partial
from typing import Any, Final, NamedTuple

from opentelemetry import metrics, trace

from otel_hicache import semconv as sc
from otel_hicache.capacity import CapacityFeed
from otel_hicache.integrations._once import warn_once
from otel_hicache.integrations._patching import AdapterSwitch, Skips
from otel_hicache.records import PoolUsage
from otel_hicache.telemetry import DeferredQueue, HiCacheTelemetry

#: Entries an adapter remembers per engine object (submitted transfers, links) until the engine completes them;
#: beyond this the oldest are forgotten (:func:`trim`), so what the engine never completes cannot grow memory.
MAX_PENDING: Final = 4096


class Ranks(NamedTuple):
    """A process's place in the engine's parallel layout, read when its telemetry is built."""

    #: ``tp`` / ``pp`` / ``dp`` ranks, on the Resource as ``hicache.rank.*``.
    ranks: Mapping[str, int] = {}
    #: Whether this process reports the instruments counted in tokens: true on one rank of each group whose ranks
    #: all see the same logical tokens (a sum over processes is then the logical token flow).
    token_metrics: bool = True
    #: Further Resource attributes (e.g. SGLang's attention-TP rank).
    resource: Mapping[str, Any] = {}


def trim(table: dict[Any, Any]) -> None:
    """Forget ``table``'s oldest entries beyond :data:`MAX_PENDING`; another thread may take entries meanwhile."""
    while len(table) > MAX_PENDING:
        try:
            table.pop(next(iter(table)), None)
        except (RuntimeError, StopIteration):  # it took one meanwhile
            continue


class WeakPoolSource:
    """A pool-usage source (:meth:`~otel_hicache.telemetry.HiCacheTelemetry.add_pool_usage_source`) reading
    ``read(owner)`` at collection while the engine's ``owner`` lives and ``switch`` is on, and removing itself once
    either is not."""

    __slots__ = ("__weakref__", "_owner", "_read", "_switch", "_telemetry")

    def __init__(
        self, owner: Any, read: Callable[[Any], Iterable[PoolUsage]], telemetry: HiCacheTelemetry, switch: AdapterSwitch
    ) -> None:
        self._owner = weakref.ref(owner)
        self._read = read
        self._telemetry = telemetry
        self._switch = switch

    def __call__(self) -> Iterable[PoolUsage]:
        owner = self._owner()
        if owner is None or self._switch.off:
            self._telemetry.remove_pool_usage_source(self)
            return ()
        return self._read(owner)


class ProcessSink:
    """Where an adapter's records go: one :class:`~otel_hicache.telemetry.HiCacheTelemetry` for the process.

    Given ``telemetry``, that one. Otherwise it is built by the first :meth:`get` (the process's first event, when the
    engine knows the process's ranks): from the ``OTEL_*`` environment with :func:`otel_hicache.sdk.configure`
    (``from_environment``; its meter provider becomes the global one where none is installed, if ``install_globals``:
    the engine's own series routed over OTel need it; no tracer provider is installed, so that over OTLP the process
    runs no span processor of ours for nothing: an engine that traces requests installs its own first), or
    on ``providers`` (the global ones where ``None``). A build that fails is logged once and not retried: the process
    then reports nothing.
    """

    def __init__(
        self,
        engine: sc.Engine,
        *,
        telemetry: HiCacheTelemetry | None = None,
        extra_pools: Sequence[str] = (),
        providers: tuple[trace.TracerProvider | None, metrics.MeterProvider | None] = (None, None),
        from_environment: bool = False,
        install_globals: bool = False,
    ) -> None:
        self.engine = engine
        self.telemetry = telemetry
        self.switch = AdapterSwitch(engine.value)  # set to the release by the instrumentor; off on an untested mismatch
        self.setup: Any = None  # the TelemetrySetup that owns a telemetry built from the environment
        self._extra_pools = tuple(extra_pools)
        self._providers = providers
        self._from_environment = from_environment
        self._install_globals = install_globals
        self._done = telemetry is not None
        self._lock = threading.Lock()
        self._patient: dict[sc.RecordKind, DeferredQueue] = {}

    def get(self, ranks: Callable[[], Ranks] | None = None) -> HiCacheTelemetry | None:
        """The process's telemetry, built now (with ``ranks()``) if this is its first event."""
        if self._done:
            return self.telemetry
        with self._lock:
            if not self._done:
                try:
                    self.telemetry = self._build(Ranks() if ranks is None else ranks())
                except Exception as exc:
                    warn_once(
                        f"sink:{self.engine}",
                        "otel_hicache: %s is not reported in this process: %s",
                        self.engine.value,
                        exc,
                        exc_info=not isinstance(exc, ValueError),  # a ConfigError says it all in one line
                    )
                self._done = True
        return self.telemetry

    def patient(
        self, kind: sc.RecordKind, build: Callable[[HiCacheTelemetry, list[tuple[Any, ...]]], None]
    ) -> DeferredQueue | None:
        """The process's patient queue of ``kind`` records (made at the first call, once the telemetry is built; None
        while the process reports nothing): the producer puts ``(next(queue.seq), ...)`` with ``queue.put``, and the
        telemetry's host thread hands the entries waiting, a batch at a time, to ``build(telemetry, entries)``, at
        most four times a second (``deferred_queue(..., patient=True)``). For records that only add to counts, off a
        thread each step waits for."""
        queue = self._patient.get(kind)
        if queue is None:
            telemetry = self.telemetry
            if telemetry is None:
                return None
            with self._lock:
                queue = self._patient.get(kind)
                if queue is None:
                    queue = self._patient[kind] = telemetry.deferred_queue(
                        partial(build, telemetry), batched=True, kind=kind, patient=True
                    )
        return queue

    def release(self) -> None:
        """The sink is replaced (an instrumentor given other arguments): its patient queues are closed, dropped by
        their telemetry once drained."""
        with self._lock:
            queues, self._patient = list(self._patient.values()), {}
        for queue in queues:
            queue.close()

    def _build(self, ranks: Ranks) -> HiCacheTelemetry:
        if not self._from_environment:
            return HiCacheTelemetry(*self._providers, extra_pools=self._extra_pools, token_metrics=ranks.token_metrics)
        from otel_hicache.sdk import configure

        self.setup = setup = configure(
            ranks=dict(ranks.ranks),
            resource_attributes={sc.RESOURCE_ENGINE: self.engine.value, **ranks.resource},
            extra_pools=self._extra_pools,
            token_metrics=ranks.token_metrics,
        )
        if self._install_globals and _unset(metrics.get_meter_provider()):
            metrics.set_meter_provider(setup.meter_provider)
        return setup.telemetry


class EngineHooks:
    """Base of an adapter's groups of wrappers (wrapt signature ``(wrapped, instance, args, kwargs)``): they report
    through the process's :class:`ProcessSink`, built at the first event with the engine's rank rule, ``ranks(*at)``
    (what the rank is read from, where the engine does not publish it per process)."""

    def __init__(self, sink: ProcessSink, ranks: Callable[..., Ranks] | None = None) -> None:
        self.sink = sink
        self._ranks = ranks
        # the engine's objects that skip some of these hooks (Skips), each made once; detach() ends them
        self._skipping: weakref.WeakKeyDictionary[Any, Skips] = weakref.WeakKeyDictionary()
        self._skipping_lock = threading.Lock()

    @property
    def telemetry(self) -> HiCacheTelemetry | None:
        """The process's telemetry, once built."""
        return self.sink.telemetry

    def _skips(self, instance: Any, attributes: Iterable[str]) -> Skips:
        """``instance``'s :class:`Skips` of our wrappers of ``attributes`` (made at the first call); :meth:`detach`
        ends it."""
        skips = self._skipping.get(instance)
        if skips is None:
            with self._skipping_lock:
                skips = self._skipping.get(instance)
                if skips is None:
                    skips = self._skipping[instance] = Skips(instance, attributes)
        return skips

    def _sink(self, *at: Any) -> HiCacheTelemetry | None:
        """The process's telemetry, built now (with ``ranks(*at)``) if this is its first event; ``None`` when this
        process reports nothing."""
        ranks = self._ranks
        return self.sink.get(None if ranks is None else lambda: ranks(*at))

    def detach(self) -> None:
        """``uninstrument()``: undo what the hooks changed on the engine's objects: every object calls our wrappers
        again."""
        with self._skipping_lock:
            skipping, self._skipping = list(self._skipping.values()), weakref.WeakKeyDictionary()
        for skips in skipping:
            skips.end()

    def _patient(
        self, kind: sc.RecordKind, build: Callable[[HiCacheTelemetry, list[tuple[Any, ...]]], None], *at: Any
    ) -> DeferredQueue | None:
        """The process's patient queue of ``kind`` (:meth:`ProcessSink.patient`), its telemetry built now (with
        ``ranks(*at)``) if this is its first event; ``None`` when this process reports nothing."""
        return None if self._sink(*at) is None else self.sink.patient(kind, build)


class CapacityFeeder(EngineHooks, ABC):
    """Base of an engine's hooks feeding the process's capacity estimator: the feed is made once, at the first
    admission (:meth:`_feed_for`, under a lock; None: this process feeds nothing)."""

    def __init__(self, sink: ProcessSink, ranks: Callable[..., Ranks] | None = None) -> None:
        super().__init__(sink, ranks)
        self._feed: CapacityFeed | None = None
        self._started = False
        self._lock = threading.Lock()

    def feed(self, instance: Any) -> CapacityFeed | None:
        """The process's feed over the engine's cache ``instance`` (made at the first call), or None."""
        if self._started:
            return self._feed
        with self._lock:
            if not self._started:
                self._started = True
                self._feed = self._feed_for(instance)
            return self._feed

    @abstractmethod
    def _feed_for(self, instance: Any) -> CapacityFeed | None:
        """The process's feed over the engine's cache ``instance`` (the wrapped method's object), or None."""


class AdmissionHooks(CapacityFeeder, ABC):
    """Base of an engine's admission wrapper feeding the capacity estimator one admitted request per call, handed
    over as what :meth:`_payload` returns (the engine's block hashes and the prompt's length; None: left out)."""

    def admitted(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        result = wrapped(*args, **kwargs)
        feed = self.feed(instance)
        if feed is not None:
            payload = self._payload(args, kwargs)
            if payload is not None:
                feed.put_hashes(*payload)
        return result

    @abstractmethod
    def _payload(self, args: tuple, kwargs: dict) -> tuple[Sequence[bytes], int] | None:
        """The page keys of one admitted request, digests (:meth:`~otel_hicache.capacity.CapacityFeed.put_hashes`),
        and its prompt length; None: left out."""


def _unset(provider: Any) -> bool:
    """Whether ``provider`` is OTel's placeholder (nothing installed yet)."""
    return type(provider).__name__ == "_ProxyMeterProvider"
