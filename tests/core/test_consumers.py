"""The in-process consumer (``_internal.host.consumers.InProcessConsumer``): the host thread's drain works in slices and
says whether more is waiting; a flush empties the ring; what was taken is settled, so its slots are free again."""

from __future__ import annotations

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from otel_hicache import semconv as sc
from otel_hicache._internal.host import validation
from otel_hicache._internal.host.consumers import InProcessConsumer
from otel_hicache._internal.shared.accumulation import Layout
from otel_hicache._internal.shared.channel import HEADER_INTS, Channel
from otel_hicache.records import TransferRecord
from otel_hicache.semconv import TransferOperation

KNOWN = {pool: pool for pool in sc.POOLS}


def ring_with(transfers: int) -> Channel:
    channel = Channel(Layout([*sorted(KNOWN), sc.OTHER_POOL], ["kv"], HEADER_INTS), 64, shared=False)
    for i in range(transfers):
        record = TransferRecord(TransferOperation.LOAD_BACK, {"kv": i + 1}, 64, 1_000 + i, 2_000 + i)
        assert channel.put_transfer(validation.transfer(record, KNOWN))
    return channel


def consumer_of(channel: Channel) -> tuple[InProcessConsumer, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    consumer = InProcessConsumer(channel, provider, None, spans=True, token_metrics=True, before_collect=lambda: None)
    return consumer, exporter


def test_a_drain_works_within_its_budget_and_says_whether_records_are_still_waiting() -> None:
    channel = ring_with(20)
    consumer, exporter = consumer_of(channel)
    assert consumer.drain(budget_ns=0)  # no time: nothing taken, and it says so
    assert channel.pending() == 20 and not exporter.get_finished_spans()
    assert not consumer.drain(budget_ns=10**10)  # time enough: all of it, nothing left
    spans = exporter.get_finished_spans()
    assert [s.attributes[sc.ATTR_TOKENS] for s in spans if s.attributes] == list(range(1, 21))
    assert channel.pending() == 0


def test_a_flush_turns_every_waiting_record_into_its_span() -> None:
    channel = ring_with(5)
    consumer, exporter = consumer_of(channel)
    assert consumer.flush(5.0)
    assert [s.name for s in exporter.get_finished_spans()] == ["hicache.load_back"] * 5


def test_what_was_emitted_is_settled_so_the_ring_takes_as_many_again() -> None:
    channel = ring_with(64)  # full
    consumer, _ = consumer_of(channel)
    record = TransferRecord(TransferOperation.BACKUP, {"kv": 1}, 64, 1, 2)
    assert not channel.put_transfer(validation.transfer(record, KNOWN))
    assert consumer.flush(5.0)
    assert all(channel.put_transfer(validation.transfer(record, KNOWN)) for _ in range(64))


def test_across_fork_the_consumer_is_held_and_a_held_consumer_drains_nothing() -> None:
    channel = ring_with(3)
    consumer, exporter = consumer_of(channel)
    held = consumer.before_fork()
    assert held and not consumer.drain(budget_ns=10**9)  # no span half-emitted while a fork copies the process
    consumer.after_fork_in_parent(held)
    assert not consumer.drain(budget_ns=10**9) and len(exporter.get_finished_spans()) == 3
