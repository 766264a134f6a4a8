"""Per request: which tier served its prefill, how long it waited for its KV from the CPU tier, and - with vLLM's
request tracing on (``--otlp-traces-endpoint``) - all of it on vLLM's own request span, which the transfer spans that
served the request link to.

A request lives in three kinds of process. The scheduler (engine core) admits it and knows its tier split and its
wait; a worker copies its KV; the frontend (API server, or the offline ``LLM``'s process) creates vLLM's request span
``llm_request`` when it finishes, from ``EngineCoreOutput.trace_headers`` - the request's trace context, which vLLM
carries from the frontend to the engine core and back. That carrier is how the answers travel:

* scheduler, ``Scheduler.add_request``: with tracing on, the request span's identity is chosen here - the trace id of
  the request's ``traceparent`` (a new one when it has none) and a new span id - and kept on vLLM's ``Request``;
* scheduler, ``OffloadingConnectorScheduler.get_num_new_matched_tokens``: whether the connector loads the request's
  hit asynchronously (the step that admits it starts its wait) or within the step (vLLM >= 0.33's sync loads, with
  ``sync_load_budget_bytes``: ``load_kv_async`` false);
* scheduler, ``OffloadingConnectorScheduler.update_state_after_alloc`` (admission, or a step later for a deferred
  load): the tier split of vLLM's own ``PrefillStats`` (``device_hit`` = its local prefix-cache hit, ``host_hit`` /
  ``storage_hit`` / ``other`` = the connector's hit by source, ``get_external_cache_hit_sources``; ``input`` = the
  rest), counted once per request in ``hicache.prefill.tokens``; the tier its KV loads from;
* scheduler, ``Scheduler._update_waiting_for_remote_kv``: the request leaves ``WAITING_FOR_REMOTE_KVS``, the state in
  which vLLM keeps a request while the connector loads its KV asynchronously: ``hicache.request.kv_wait{tier}`` is
  that interval from its admission, a deferred load's deferral included. A
  request that loaded nothing waited for nothing and records nothing;
* worker, then scheduler, ``Scheduler.update_from_output``: a sync load never enters that state; the worker's
  ``start_kv_transfers`` waits for it inside the step, and how long it waited travels back in the step's worker
  metadata (:mod:`.hooks`): that is the request's ``hicache.request.kv_wait{tier}``;
* scheduler, ``OffloadingConnectorScheduler.build_connector_meta``: each load and store job of a traced request
  carries the request span's context to the worker (an attribute of the connector metadata, which vLLM pickles to its
  workers); the transfer span links to it;
* the split, the wait and the span's identity ride back to the frontend in the request's ``trace_headers`` (key
  :data:`HEADER`); there ``OutputProcessor.do_tracing`` creates ``llm_request``, and our wrappers give it that
  identity (an id generator on the tracer provider that hands out the chosen ids for that one span, and passes every
  other call to the provider's own) and the attributes ``hicache.prefix.tokens.<mode>`` and ``hicache.kv_wait.<tier>``.

The split and the wait are counted on the telemetry's host thread: each step of the scheduler waits for what runs on
its thread, so it only puts one tuple of numbers on a patient queue (:meth:`~.._sink.ProcessSink.patient`), taken
four times a second.

No request, token or block id reaches a metric; the request span's ids are span identity, as vLLM's own.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Mapping
from itertools import chain
from typing import Any, NamedTuple

from opentelemetry import trace
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.trace import TraceFlags

from otel_hicache import semconv as sc
from otel_hicache.integrations._base import EngineHooks, ProcessSink, Ranks, warn_once
from otel_hicache.integrations.vllm.semconv import LINKS, SYNC_WAITS
from otel_hicache.records import KvWait
from otel_hicache.telemetry import HiCacheTelemetry
from otel_hicache.timing import now_ns

#: The ``trace_headers`` key that carries the request span's identity and our attributes back to the frontend.
HEADER = "otel-hicache"
#: The attribute of vLLM's ``Request`` that holds our state of it (lives and dies with vLLM's request).
_STATE = "_otel_hicache"
#: vLLM's request span.
REQUEST_SPAN = "llm_request"
#: vLLM's hit sources (``CacheHitSource``) as our prefill modes; any other source is a hit of kind ``other``.
_SOURCES = {"host": sc.PrefillMode.HOST_HIT, "disk": sc.PrefillMode.STORAGE_HIT}
#: The attributes the frontend accepts from the header: a closed set.
_ATTRIBUTES = frozenset(
    {f"{sc.ATTR_PREFIX_TOKENS}.{mode.value}" for mode in sc.PrefillMode}
    | {f"{sc.ATTR_KV_WAIT}.{tier.value}" for tier in (sc.Tier.HOST, sc.Tier.STORAGE)}
)


class Identity(NamedTuple):
    """A request span's identity: trace id, span id, trace flags."""

    trace_id: int
    span_id: int
    flags: int


class _Request:
    """Our state of one vLLM request (an attribute of vLLM's ``Request``)."""

    __slots__ = ("attributes", "identity", "matched_ns", "split_counted", "sync_load", "wait_start_ns", "wait_tier")

    def __init__(self, identity: Identity | None) -> None:
        self.identity = identity
        self.attributes: dict[str, int | float] = {}
        self.split_counted = False
        self.matched_ns = 0  # when the connector last answered that it loads KV asynchronously
        self.sync_load = False  # its last answer: a load within the step (vLLM >= 0.33's sync loads)
        self.wait_start_ns = 0
        self.wait_tier = sc.Tier.HOST


class RequestHooks(EngineHooks):
    """The wrappers of vLLM's scheduler and frontend that follow requests."""

    def __init__(self, sink: ProcessSink, ranks: Callable[[Any], Ranks]) -> None:
        super().__init__(sink, ranks)
        self._span = threading.local()  # in the frontend: the payload of the request span being created
        self._ids: _RequestIds | None = None
        self._traced = False  # in the scheduler: a request with a request span was admitted (vLLM's tracing is on)
        self._sync_loads = False  # in the scheduler: the connector answered a load within the step (vLLM >= 0.33)

    # ------------------------------------------------------------------ scheduler (engine core)
    def add_request(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        """``Scheduler.add_request(request)``: with vLLM's tracing on, choose the request span's identity."""
        request = args[0] if args else kwargs["request"]
        if instance.observability_config.otlp_traces_endpoint is not None:
            if not self._traced:
                self._traced = True
                self.detach()  # every connector's build_connector_meta links jobs to request spans from now on
            setattr(request, _STATE, _Request(_identity(request.trace_headers)))
            _publish(request)
        return wrapped(*args, **kwargs)

    def get_num_new_matched_tokens(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        """``OffloadingConnectorScheduler.get_num_new_matched_tokens(request, ...)``: the connector's answer, asked in
        every step until the request is admitted. An asynchronous load's wait starts at the answer of the step that
        admits the request (its load may start steps later: deferred loads); a load within the step (``load_kv_async``
        false) is timed by the worker that waits for it."""
        result = wrapped(*args, **kwargs)
        tokens, load_async = result
        if tokens:
            request = args[0] if args else kwargs["request"]
            state = _state(request)
            state.sync_load = not load_async
            if state.sync_load and not self._sync_loads:
                self._sync_loads = True
                self.detach()  # every scheduler's update_from_output reads the workers' sync waits from now on
            state.matched_ns = 0 if state.sync_load else time.monotonic_ns()
        return result

    def update_state_after_alloc(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        """``OffloadingConnectorScheduler.update_state_after_alloc(request, blocks, num_external_tokens)``: the
        request is admitted (or, for a deferred load, its load starts); with KV to load asynchronously, it waits for
        it from its admission."""
        result = wrapped(*args, **kwargs)
        request, external = _alloc_arguments(*args, **kwargs)
        state = _state(request)
        sources = instance.get_external_cache_hit_sources(request, external) if external else {}
        if not state.split_counted and request.num_preemptions == 0 and request.prefill_stats is not None:
            state.split_counted = True
            self._count_split(state, request.prefill_stats, sources)
        if external:
            # a sync load's wait comes from the worker (sync_waits); an async one's ends when the request leaves
            # WAITING_FOR_REMOTE_KVS
            state.wait_start_ns = 0 if state.sync_load else state.matched_ns or time.monotonic_ns()
            kinds = {str(getattr(s, "value", s)) for s in sources}
            state.wait_tier = sc.Tier.STORAGE if kinds == {"disk"} else sc.Tier.HOST
        state.matched_ns, state.sync_load = 0, False
        _publish(request)
        return result

    def _count_split(self, state: _Request, stats: Any, sources: Mapping[Any, int]) -> None:
        host = storage = other = 0
        for source, tokens in sources.items():
            mode = _SOURCES.get(str(getattr(source, "value", source)))
            if mode is sc.PrefillMode.HOST_HIT:
                host += int(tokens)
            elif mode is sc.PrefillMode.STORAGE_HIT:
                storage += int(tokens)
            else:
                other += int(tokens)
        row = (int(stats.num_computed_tokens), int(stats.num_local_cached_tokens), host, storage, other)
        queue = self._patient(sc.RecordKind.PREFIX_SPLIT, _count_splits, None)
        if queue is not None:
            queue.put((next(queue.seq), row))
        if state.identity is not None:  # for its request span (vLLM's tracing on): nothing else reads them
            modes = zip(sc.PrefillMode, row, strict=True)  # the row's order
            state.attributes.update({f"{sc.ATTR_PREFIX_TOKENS}.{mode.value}": n for mode, n in modes})

    def update_waiting_for_remote_kv(
        self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict
    ) -> Any:
        """``Scheduler._update_waiting_for_remote_kv(request)``: its KV is in, it leaves ``WAITING_FOR_REMOTE_KVS``."""
        request = args[0] if args else kwargs["request"]
        state = getattr(request, _STATE, None)
        if state is not None and state.wait_start_ns:
            wait_s = (time.monotonic_ns() - state.wait_start_ns) / 1e9
            state.wait_start_ns = 0
            self._waited(request, state, wait_s)
        return wrapped(*args, **kwargs)

    def update_from_output(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        """``Scheduler.update_from_output(scheduler_output, model_runner_output)``: the step's worker metadata
        carries how long the workers waited for its sync loads (:data:`~.semconv.SYNC_WAITS`, per request); each is
        that request's wait, recorded before vLLM builds the step's outputs (a request may finish in this step).
        Until the connector answers a sync load (never before vLLM 0.33, nor without ``sync_load_budget_bytes``) there
        is none to read, and the scheduler's steps call vLLM's method directly from the second on: the answer comes
        in ``schedule()``, before the step's outputs."""
        if not self._sync_loads:
            self._skips(instance, ("update_from_output",)).set("update_from_output", True)
        output = args[1] if len(args) > 1 else kwargs["model_runner_output"]
        connector_output = getattr(output, "kv_connector_output", None)
        waits = getattr(getattr(connector_output, "kv_connector_worker_meta", None), SYNC_WAITS, None)
        if waits:
            for req_id, wait_s in waits.items():
                request = instance.requests.get(req_id)
                state = None if request is None else getattr(request, _STATE, None)
                if state is not None:
                    self._waited(request, state, float(wait_s))
        return wrapped(*args, **kwargs)

    def _waited(self, request: Any, state: _Request, wait_s: float) -> None:
        """The request waited ``wait_s`` for its KV: its ``hicache.request.kv_wait`` and request span attribute."""
        if state.identity is not None:  # vLLM's tracing on: the request span's attribute
            state.attributes[f"{sc.ATTR_KV_WAIT}.{state.wait_tier.value}"] = wait_s
            _publish(request)
        queue = self._patient(sc.RecordKind.KV_WAIT, _count_waits, None)
        if queue is not None:
            queue.put((next(queue.seq), state.wait_tier, wait_s, now_ns()))

    def build_connector_meta(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        """``OffloadingConnectorScheduler.build_connector_meta``: give each job of a traced request its request span's
        context, for the worker's transfer span to link to."""
        meta = wrapped(*args, **kwargs)
        if not self._traced:  # vLLM's tracing is off: no request span to link to, the connector's steps skip this
            self._skips(instance, ("build_connector_meta",)).set("build_connector_meta", True)
            return meta
        links = {}
        requests = instance._req_status
        for job_id, job in chain(meta.load_jobs.items(), meta.store_jobs.items()):
            status = requests.get(job.req_id)
            state = None if status is None else getattr(status.req, _STATE, None)
            if state is not None and state.identity is not None:
                links[job_id] = tuple(state.identity)
        if links:
            setattr(meta, LINKS, links)
        return meta

    # ------------------------------------------------------------------ frontend
    def do_tracing(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        """``OutputProcessor.do_tracing(engine_core_output, ...)``: vLLM creates a finished request's span; note what
        the engine core sent for it."""
        output = args[0] if args else kwargs["engine_core_output"]
        payload = _parse((output.trace_headers or {}).get(HEADER))
        if payload is None:
            return wrapped(*args, **kwargs)
        self._span.payload = payload
        try:
            return wrapped(*args, **kwargs)
        finally:
            self._span.payload = None

    def instrument_manual(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        """``vllm.tracing.instrument_manual`` as the output processor calls it: the request span gets its identity
        and our attributes."""
        payload = getattr(self._span, "payload", None)
        ids = None
        if payload is not None and _span_name(*args, **kwargs) == REQUEST_SPAN:
            identity, attributes = payload
            args, kwargs = _with_attributes(args, kwargs, attributes)
            if identity is not None:
                ids = self._id_generator()
                if ids is not None:
                    ids.next.identity = identity
        try:
            return wrapped(*args, **kwargs)
        finally:
            if ids is not None and getattr(ids.next, "identity", None) is not None:
                ids.next.identity = None  # not taken: the tracer's ids come from elsewhere
                warn_once(
                    "vllm:request-span-ids",
                    "otel_hicache: vLLM's request span did not take the identity the engine core chose for it (its "
                    "tracer was made before ours was installed); the transfer spans' links to request spans may "
                    "dangle.",
                )

    def _id_generator(self) -> _RequestIds | None:
        """Ours, on the global tracer provider (installed at the first request span)."""
        if self._ids is None:
            provider = trace.get_tracer_provider()
            inner = getattr(provider, "id_generator", None)
            if isinstance(inner, _RequestIds):
                self._ids = inner
            elif isinstance(inner, IdGenerator):
                self._ids = _RequestIds(inner)
                provider.id_generator = self._ids  # type: ignore[attr-defined]
        return self._ids


class _RequestIds(IdGenerator):
    """The tracer provider's id generator, except for the one request span being created on this thread, which gets
    the identity chosen in the engine core (``next.identity``, taken by its span id)."""

    def __init__(self, inner: IdGenerator) -> None:
        self.inner = inner
        self.next = threading.local()

    def generate_trace_id(self) -> int:  # called for a root span only, before its span id
        identity = getattr(self.next, "identity", None)
        return self.inner.generate_trace_id() if identity is None else identity.trace_id

    def generate_span_id(self) -> int:
        identity = getattr(self.next, "identity", None)
        if identity is None:
            return self.inner.generate_span_id()
        self.next.identity = None
        return int(identity.span_id)

    def is_trace_id_random(self) -> bool:
        return self.inner.is_trace_id_random()


def _count_splits(telemetry: HiCacheTelemetry, entries: list[tuple[int, tuple[int, int, int, int, int]]]) -> None:
    """Host thread: the splits of the requests admitted since its last round (:meth:`RequestHooks._count_split`),
    summed: one count."""
    telemetry.record_prefix_splits(row for _, row in entries)


def _count_waits(telemetry: HiCacheTelemetry, entries: list[tuple[int, sc.Tier, float, int]]) -> None:
    """Host thread: the KV waits that ended since its last round (:meth:`RequestHooks._waited`)."""
    for _, tier, wait_s, when_ns in entries:
        telemetry.record_kv_wait(KvWait(tier, wait_s, when_ns))


def _identity(headers: Mapping[str, str] | None) -> Identity:
    """The request span's identity: in the trace of the request's ``traceparent`` (a new trace when it has none)."""
    trace_id, flags = 0, int(TraceFlags.SAMPLED)
    parent = (headers or {}).get("traceparent", "")
    parts = parent.split("-")
    if len(parts) == 4 and len(parts[1]) == 32 and len(parts[3]) == 2:
        try:
            trace_id, flags = int(parts[1], 16), int(parts[3], 16)
        except ValueError:
            trace_id = 0
    while not trace_id:
        trace_id = random.getrandbits(128)
    span_id = 0
    while not span_id:
        span_id = random.getrandbits(64)
    return Identity(trace_id, span_id, flags & 0xFF)


def _state(request: Any) -> _Request:
    """Our state of ``request``, made now if it has none (vLLM's tracing off)."""
    state = getattr(request, _STATE, None)
    if state is None:
        state = _Request(None)
        setattr(request, _STATE, state)
    return state


def _publish(request: Any) -> None:
    """Put our state of ``request`` into its ``trace_headers`` (what vLLM sends back to the frontend with it)."""
    state = getattr(request, _STATE)
    if state.identity is None:  # vLLM's tracing is off: there is no request span
        return
    identity = "" if state.identity is None else "{:032x}-{:016x}-{:02x}".format(*state.identity)
    value = ";".join([identity, *(f"{k}={v!r}" for k, v in state.attributes.items())])
    headers = dict(request.trace_headers or {})
    headers[HEADER] = value
    request.trace_headers = headers


def _parse(value: Any) -> tuple[Identity | None, dict[str, int | float]] | None:
    """The request span's identity and attributes from :data:`HEADER` (only known attributes, only numbers)."""
    if not isinstance(value, str):
        return None
    head, *pairs = value.split(";")
    identity = None
    if head:
        trace_id, span_id, flags = (int(part, 16) for part in head.split("-"))
        identity = Identity(trace_id, span_id, flags)
    attributes: dict[str, int | float] = {}
    for pair in pairs:
        key, _, number = pair.partition("=")
        if key in _ATTRIBUTES:
            attributes[key] = float(number) if "." in number or "e" in number else int(number)
    return identity, attributes


def _alloc_arguments(request: Any, blocks: Any, num_external_tokens: int) -> tuple[Any, int]:
    return request, int(num_external_tokens)


def _span_name(span_name: str, *args: Any, **kwargs: Any) -> str:
    return span_name


def _with_attributes(args: tuple, kwargs: dict, extra: dict[str, int | float]) -> tuple[tuple, dict]:
    """``instrument_manual``'s arguments with ``extra`` added to its ``attributes`` (its fourth parameter)."""
    if len(args) > 3:
        merged = {**(args[3] or {}), **extra}
        return (*args[:3], merged, *args[4:]), kwargs
    return args, {**kwargs, "attributes": {**(kwargs.get("attributes") or {}), **extra}}
