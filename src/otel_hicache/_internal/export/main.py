"""The export process's program: builds a host's spans and metrics from its channel and exports them.

Launched by the host's handle (:class:`~otel_hicache._internal.export.handle.ExportProcess`, which describes the
process's life: the launch, the pipes, the handover); its boot (:mod:`otel_hicache._internal.export.boot`) reads the
:class:`~otel_hicache._internal.shared.plan.ExportPlan` and calls :func:`main`. Metrics are read from the shared table
at each collection by the readers' own threads; nothing here holds a metric. The ring is the exporter's only span queue:
the main thread builds spans from the ring's transfers with a processor that only collects them, and a thread of its own
sends them (as the SDK's batch processor would: ``OTEL_BSP_MAX_EXPORT_BATCH_SIZE`` at a time, at least every
``OTEL_BSP_SCHEDULE_DELAY``) and then settles their slots. So a send that blocks (a black-hole collector, an exporter
retrying) delays neither a metric read nor the building of the next spans: it holds only the slots of its own spans,
until it returns - within the span exporter's timeout (``OTEL_EXPORTER_OTLP_TRACES_TIMEOUT``, 10 s by default), the
bound of every OTLP export. A span whose export fails is counted in ``otel_hicache.records.dropped``; a replacement for
a dead exporter sends again what its predecessor had not settled, under the same span and trace ids (an OTLP retry).
Everything is exported under the host's Resource, with the providers :mod:`otel_hicache._internal.emit.providers`
builds for ``configure()`` too (and their exporters, from :mod:`otel_hicache._internal.emit.exporters`).
"""

from __future__ import annotations

import hashlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.id_generator import IdGenerator

from otel_hicache._internal.emit.emitter import Emitter
from otel_hicache._internal.emit.providers import build
from otel_hicache._internal.export.capacity import RingEstimator
from otel_hicache._internal.shared.accumulation import Layout
from otel_hicache._internal.shared.channel import (
    EXPORT_DROPPED,
    EXPORTER_PID,
    FLUSH_DONE,
    FLUSH_REQ,
    HEADER_INTS,
    ID_SEED,
    READ,
    SETTLED,
    SPANS_EXPORTED,
    Channel,
)
from otel_hicache._internal.shared.plan import LOG_LINE, MAX_LINE_BYTES, ExportPlan
from otel_hicache.config import validate

_log = logging.getLogger(__name__)

#: How often the exporter looks at the ring when the host sends nothing.
POLL_INTERVAL_S = 0.1
#: How much lower the exporter's CPU priority is than the host's (``nice``): it yields the cores to the scheduler.
EXPORTER_NICENESS = 10
#: The longest the exporter works on its last export after the host is gone.
FINAL_TIMEOUT_S = 5.0


class OncePerLogger(logging.Filter):
    """One line per logger: a dead collector gets one line, not one per export attempt (the SDK's own
    ``otel.sdk.*`` metrics and ``otel_hicache.records.dropped`` count every lost span)."""

    def __init__(self) -> None:
        super().__init__()
        self._seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name in self._seen:
            return False
        self._seen.add(record.name)
        return True


#: The SDK loggers that speak once per failed export; :func:`quiet_exporters` lets one line of each through.
EXPORTER_LOGGERS = (
    "opentelemetry.exporter.otlp.proto.grpc.exporter",
    "opentelemetry.exporter.otlp.proto.http.trace_exporter",
    "opentelemetry.exporter.otlp.proto.http.metric_exporter",
    "opentelemetry.sdk._shared_internal",
    "opentelemetry.sdk.metrics._internal.export",
)


def quiet_exporters() -> None:
    """A dead collector costs one log line per kind of failure, not one per export attempt (the export process's
    own exporters: in a host, the loggers are the app's too)."""
    for name in EXPORTER_LOGGERS:
        logging.getLogger(name).addFilter(OncePerLogger())


class _Relayed(logging.Handler):
    """Log records as lines on standard error, which is the liveness pipe the host relays into its own logging; a
    line the pipe cannot take now (the host is not reading, or gone) is dropped, never waited for."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = self.format(record).replace("\n", " | ").encode("utf-8", "replace")[:MAX_LINE_BYTES]
            os.write(2, LOG_LINE + b"%d %s\n" % (record.levelno, text))
        except (OSError, ValueError):
            pass


class RingIds(IdGenerator):
    """Span and trace ids from the ring: the slot's sequence number, keyed by the ring's seed. A replacement exporter
    building a record again gives its span the ids it had (an OTLP retry, which a backend can deduplicate)."""

    def __init__(self, seed: int) -> None:
        self._key = seed.to_bytes(8, "little")
        self._digest = bytes(24)

    def at(self, sequence: int) -> None:
        """The next span is that of the record at ``sequence``."""
        self._digest = hashlib.blake2b(sequence.to_bytes(8, "little"), digest_size=24, key=self._key).digest()

    def generate_trace_id(self) -> int:
        return int.from_bytes(self._digest[:16], "big") or 1

    def generate_span_id(self) -> int:
        return int.from_bytes(self._digest[16:], "big") or 1


class Collect(SpanProcessor):
    """Keeps every ended span until taken: the export process sends them itself, synchronously."""

    def __init__(self) -> None:
        self.spans: list[ReadableSpan] = []

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        return None

    def on_end(self, span: ReadableSpan) -> None:
        self.spans.append(span)

    def take(self) -> list[ReadableSpan]:
        spans, self.spans = self.spans, []
        return spans


class _Job(NamedTuple):
    """Spans for the sending thread: the ring's slots before ``upto`` are free once they are sent (or counted lost);
    ``flush``: a flush request to answer once they are, after a metric export."""

    spans: list[ReadableSpan]
    upto: int
    flush: int


class _Sender:
    """Builds the ring's transfers into spans (:meth:`build`, on the main thread) and sends them on a thread of its
    own, one job at a time (:meth:`hand`): ``batch`` spans per export, at least every ``delay_s`` (the SDK batch
    processor's rule); then settles their slots. A span an exporter did not take is counted as dropped once."""

    def __init__(
        self,
        channel: Channel,
        emit: Callable[[Any], None],
        ids: RingIds,
        collect: Collect,
        exporters: Sequence[SpanExporter],
        batch: int,
        delay_s: float,
        flush_metrics: Callable[[], object],
    ) -> None:
        self._channel, self._emit, self._ids, self._collect = channel, emit, ids, collect
        self._exporters, self._batch, self._delay_s = exporters, batch, delay_s
        self._flush_metrics = flush_metrics
        self._since = 0.0  # when the oldest span not handed over was built
        self._state = threading.Condition()
        self._job: _Job | None = None  # handed over, not yet taken by the sending thread
        self._busy = False  # the sending thread is sending a job
        threading.Thread(target=self._run, name="otel-hicache-send-spans", daemon=True).start()

    def build(self) -> None:
        channel, ids = self._channel, self._ids
        while True:
            first = channel.ints[READ]
            records = channel.take(512)
            if not records:
                break
            for i, record in enumerate(records):
                ids.at(first + i)
                try:
                    self._emit(record)
                except Exception:
                    _log.debug("emitting a record failed", exc_info=True)
        if self._collect.spans:
            self._since = self._since or time.monotonic()
            return
        with self._state:
            if not self._busy and self._job is None:
                channel.settle()  # nothing waits to be sent: what was built is done with

    def due(self) -> bool:
        held = len(self._collect.spans)
        return held >= self._batch or (held > 0 and time.monotonic() - self._since >= self._delay_s)

    def hand(self, flush: int = 0) -> bool:
        """Give the sending thread every span built so far (and a flush request to answer); False while it is still
        sending the previous job (the spans wait, in the ring's slots)."""
        with self._state:
            if self._busy or self._job is not None:
                return False
            self._job = _Job(self._collect.take(), int(self._channel.ints[READ]), flush)
            self._since = 0.0
            self._state.notify_all()
        return True

    def idle(self, timeout_s: float) -> bool:
        """Wait at most ``timeout_s`` for the sending thread to be done with every job handed over."""
        with self._state:
            return self._state.wait_for(lambda: not self._busy and self._job is None, timeout_s)

    def _run(self) -> None:
        ints = self._channel.ints
        while True:
            with self._state:
                self._state.wait_for(lambda: self._job is not None)
                job, self._job, self._busy = self._job, None, True
            assert job is not None
            for at in range(0, len(job.spans), self._batch):
                chunk: Sequence[ReadableSpan] = job.spans[at : at + self._batch]
                sent = [_export(exporter, chunk) for exporter in self._exporters]
                if all(sent):
                    ints[SPANS_EXPORTED] += len(chunk)  # this thread alone writes both
                else:
                    ints[EXPORT_DROPPED] += len(chunk)
            self._channel.settle(job.upto)
            if job.flush:
                self._flush_metrics()
                ints[FLUSH_DONE] = job.flush
            with self._state:
                self._busy = False
                self._state.notify_all()


def _export(exporter: SpanExporter, spans: Sequence[ReadableSpan]) -> bool:
    try:
        return exporter.export(spans) is SpanExportResult.SUCCESS
    except Exception:
        _log.debug("exporting spans failed", exc_info=True)
        return False


def main(hangup_fd: int, channel_fd: int, plan: ExportPlan) -> None:
    """The export process: serve the channel ``channel_fd`` until the host hangs up ``hangup_fd`` (or SIGTERM)."""
    os.set_blocking(2, False)
    handler = _Relayed()
    handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
    logging.basicConfig(level=logging.WARNING, handlers=[handler])
    logging.getLogger("otel_hicache.config").setLevel(logging.ERROR)  # the host warned about its settings already
    quiet_exporters()
    stop = threading.Event()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C meant for the host
    os.nice(EXPORTER_NICENESS)  # background work: on a busy host, the scheduler runs first

    channel = Channel(
        Layout(plan.pools, plan.seed_pools, HEADER_INTS), plan.capacity, shared=True, fd=channel_fd, ids=plan.ids
    )
    ints = channel.ints
    ids, collect = RingIds(ints[ID_SEED]), Collect()
    settings = validate(
        os.environ, endpoint=plan.endpoint, protocol=plan.protocol, cardinality_limit=plan.cardinality_limit
    )  # the host's OTEL_* variables are this process's environment, its arguments in the plan
    metrics_side, traces_side = build(settings, Resource(plan.resource), collect=collect, id_generator=ids)
    tracer_provider, meter_provider = traces_side.tracer_provider, metrics_side.meter_provider
    emitter = Emitter(
        channel.counters, tracer_provider, meter_provider, spans=plan.spans, token_metrics=plan.token_metrics
    )
    final_s = FINAL_TIMEOUT_S
    timeout_ms = int(final_s * 1000)
    batch, delay_s = settings.bsp_max_export_batch_size, settings.bsp_schedule_delay_ms / 1000
    ints[READ] = ints[SETTLED]  # what a predecessor took and never settled is built and sent again
    sender = _Sender(
        channel,
        emitter.emit,
        ids,
        collect,
        traces_side.span_exporters,
        batch,
        delay_s,
        lambda: meter_provider.force_flush(timeout_ms),
    )
    estimator = None if channel.ids is None else RingEstimator(channel, channel.ids)
    ints[EXPORTER_PID] = os.getpid()

    poke = threading.Event()
    ending_lock = threading.Lock()
    deadline = threading.Timer(final_s + 0.5, os._exit, args=(0,))
    deadline.daemon = True

    def ending() -> None:
        """The host is gone (or SIGTERM): from now on the process has ``final_s`` to live, even if the main loop is
        stuck in an export to a dead collector. Once, whether the pipe or the signal says it first."""
        if ending_lock.acquire(blocking=False):
            stop.set()
            deadline.start()
        poke.set()

    def watch_host() -> None:
        """Owns the hang-up pipe: a byte is a flush request; end of file means the host is gone."""
        while os.read(hangup_fd, 4096):
            poke.set()
        ending()

    signal.signal(signal.SIGTERM, lambda *_: ending())  # the container is going away: last export, then exit
    threading.Thread(target=watch_host, name="otel-hicache-watch-host", daemon=True).start()
    answered = 0  # the last flush request handed to the sending thread
    while not stop.is_set():
        poke.wait(POLL_INTERVAL_S)
        poke.clear()
        sender.build()
        request = int(ints[FLUSH_REQ])
        if estimator is not None:
            estimator.drain()
        if request > max(answered, ints[FLUSH_DONE]):
            if estimator is not None:
                estimator.publish()  # a flush exports the curve of every lookup the host had handed over
            if sender.hand(flush=request):  # answered once the spans so far are sent and the metrics exported
                answered = request
        elif sender.due():
            sender.hand()

    try:
        ends = time.monotonic() + final_s / 2  # half the time left for spans, whatever the collector does
        for span_exporter in traces_side.span_exporters:
            cut_off = threading.Timer(final_s / 2, span_exporter.shutdown)
            cut_off.daemon = True
            cut_off.start()
        sender.build()
        if estimator is not None:
            estimator.drain()
            estimator.publish()
        if sender.idle(ends - time.monotonic()):
            sender.hand()
        meter_provider.force_flush(timeout_ms)  # meanwhile the spans are sent
        sender.idle(ends - time.monotonic())
    finally:
        logging.shutdown()
        os._exit(0)
