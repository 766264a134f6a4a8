"""A real vLLM OpenAI server with tensor parallelism 2: its API-server, engine-core and two worker processes serve
the tiny model with its CPU tier, our plugin loaded by vLLM itself in each, exporting over OTLP into the in-process
receiver; compared with vLLM's own ``/metrics``. vLLM's own request tracing is on (``--otlp-traces-endpoint``, into
the same receiver).

The workload, over HTTP: prompts 1, 2, 3, then 1 again, from the CPU tier (16 chunks: no eviction). Requests 1 and 4
carry a client's ``traceparent``, 2 and 3 none (vLLM's request span is then the root of its own trace).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from otel_hicache.testing.otlp_receiver import OtlpReceiver, attributes
from otel_hicache.testing.vllm import BLOCK_TOKENS, PROMPT_TOKENS, environment, prompt
from tests.vllm.engine import (
    DIRECTIONS,
    Exported,
    Server,
    assert_prefill_split_equals_vllms,
    assert_transfers_equal_vllms,
    holds_what_vllm_counted,
    needs_cpu_build,
    otlp_environment,
    serve,
    vllm_total,
)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900), needs_cpu_build]

CPU_CHUNKS = 16
TP = 2
HOST = {"hicache.tier": "host", "hicache.pool": "kv"}
#: The trace context a client sends with requests 1 and 4 (W3C ``traceparent``: its trace id and its own span's id).
CLIENTS = {
    0: {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"},
    3: {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"},
}


@dataclass
class Run:
    server: Server
    exported: Exported
    idle: tuple[float, float]  # the CPU tier's (capacity, occupancy) exported before any request
    texts: list[str]
    vllm: dict[str, float]  # vLLM's /metrics after the workload

    def vllm_total(self, name: str, **labels: str) -> float:
        return vllm_total(self.vllm, name, **labels)


@pytest.fixture(scope="module")
def served(tiny_model: Path) -> Iterator[Run]:
    with OtlpReceiver() as receiver:
        env = environment(**otlp_environment(receiver, "vllm-server"))
        tracing = ("--otlp-traces-endpoint", receiver.grpc_endpoint)  # vLLM's own request tracing
        with serve(tiny_model, CPU_CHUNKS, env, *tracing, tp=TP) as server:
            yield from _workload(server, Exported(receiver))


def _workload(server: Server, exported: Exported) -> Iterator[Run]:
    # the engine core reports its CPU tier from the start: no transfer, no eviction needed
    assert exported.wait(lambda: exported.total("hicache.pool.limit", HOST) > 0, timeout_s=60)
    idle = (
        exported.total("hicache.pool.limit", HOST),
        exported.total("hicache.pool.usage", {**HOST, "hicache.slot.state": "used"}),
    )
    texts = [
        server.complete(prompt(seed), headers=CLIENTS.get(i))["choices"][0]["text"]
        for i, seed in enumerate((1, 2, 3, 1))
    ]
    for word in ("w1", "w2"):  # the steps that submit and finish the last prompt's stores
        server.complete(word, max_tokens=1)
    vllm = server.metrics()
    run = Run(server, exported, idle, texts, vllm)
    assert exported.wait(lambda: holds_what_vllm_counted(exported, vllm), timeout_s=60)
    yield run


def test_the_cpu_tiers_capacity_and_occupancy_are_exported_while_the_server_runs_evictions_or_not(
    served: Run,
) -> None:
    assert served.idle == (CPU_CHUNKS * BLOCK_TOKENS, 0)
    assert served.exported.wait(
        lambda: served.exported.total("hicache.pool.usage", {**HOST, "hicache.slot.state": "used"}) == 3 * PROMPT_TOKENS
    )
    assert served.exported.total("hicache.eviction.tokens") == 0


def test_a_prefix_evicted_from_the_engines_cache_comes_back_from_the_cpu_tier(served: Run) -> None:
    assert served.texts[3] == served.texts[0]
    assert served.vllm_total("vllm:prompt_tokens_cached_by_source_total", source="host") == PROMPT_TOKENS
    assert served.exported.total("hicache.transfer.tokens", {"hicache.operation": "load_back"}) == PROMPT_TOKENS


@pytest.mark.parametrize(("operation", "direction"), DIRECTIONS)
def test_bytes_time_and_count_summed_over_the_workers_equal_vllms_own_metrics(
    served: Run, operation: str, direction: str
) -> None:
    """vLLM counts a transfer per worker (each rank copies its own heads) and sums its workers, as we do."""
    assert_transfers_equal_vllms(served.exported, served.vllm, operation, direction)


def test_the_tier_split_of_every_prefill_equals_vllms_own(served: Run) -> None:
    split = assert_prefill_split_equals_vllms(served.exported, served.vllm)
    assert split["host_hit"] == PROMPT_TOKENS  # counted once, by the scheduler, whatever the TP size


def test_each_worker_rank_reports_its_bytes_and_only_rank_0_the_logical_tokens(served: Run) -> None:
    (engine_core,) = {r["process.pid"] for r in served.exported.resources("hicache.pool.limit")}
    sizes = served.exported.latest("hicache.transfer.size")
    workers = {resource["hicache.rank.tp"]: pid for pid, (resource, _) in sizes.items() if pid != engine_core}
    assert sorted(workers) == [0, 1]
    backup = {"hicache.operation": "backup"}
    assert all(served.exported.total("hicache.transfer.size", backup, pids={pid}) > 0 for pid in workers.values())
    reporting_tokens = set(served.exported.latest("hicache.transfer.tokens"))
    assert workers[0] in reporting_tokens and workers[1] not in reporting_tokens
    assert served.exported.total("hicache.transfer.tokens", backup) == 3 * PROMPT_TOKENS  # logical, not x TP
    assert served.server.process.pid not in sizes  # the API server never offloads: it builds nothing


def request_spans(served: Run) -> list[Span]:
    """vLLM's own request spans of the four prompts, exported by its API server."""

    def spans() -> list[Span]:
        return [
            s
            for s in served.exported.receiver.spans()
            if s.name == "llm_request" and span_attributes(s).get("gen_ai.usage.prompt_tokens") == PROMPT_TOKENS
        ]

    assert served.exported.wait(lambda: len(spans()) == 4), (
        [s.name for s in served.exported.receiver.spans()],
        [line for line in served.server.log().splitlines() if "rror" in line or "otel" in line.lower()][-30:],
    )
    return spans()


def span_attributes(span: Span) -> dict[str, Any]:
    return attributes(span.attributes)


def test_vllms_request_span_carries_the_tier_split_and_the_wait_for_the_cpu_tier(served: Run) -> None:
    spans = {s.trace_id.hex(): s for s in request_spans(served)}
    first = span_attributes(spans[CLIENTS[0]["traceparent"].split("-")[1]])
    again = span_attributes(spans[CLIENTS[3]["traceparent"].split("-")[1]])
    assert first["hicache.prefix.tokens.input"] == PROMPT_TOKENS and first["hicache.prefix.tokens.host_hit"] == 0
    assert "hicache.kv_wait.host" not in first  # it waited for nothing
    assert again["hicache.prefix.tokens.host_hit"] == PROMPT_TOKENS and again["hicache.prefix.tokens.input"] == 0
    assert again["hicache.kv_wait.host"] > 0
    (waits,) = [p for _, p in served.exported.points("hicache.request.kv_wait") if p.count]
    assert (waits.count, waits.sum) == (1, pytest.approx(again["hicache.kv_wait.host"]))


def test_the_transfer_spans_that_served_a_request_link_to_vllms_request_span_across_processes(served: Run) -> None:
    requests = {(s.trace_id, s.span_id): s for s in request_spans(served)}
    spans = served.exported.receiver.spans()
    loads = [s for s in spans if s.name == "hicache.load_back"]
    backups = [s for s in spans if s.name == "hicache.backup"]
    assert len(loads) == TP  # each worker loads its heads of the returning prompt
    for transfer in loads + backups:
        (link,) = transfer.links
        assert (link.trace_id, link.span_id) in requests, transfer.name  # a request span vLLM exported
    again = CLIENTS[3]["traceparent"].split("-")[1]
    assert {link.trace_id.hex() for s in loads for link in s.links} == {again}
    # each distinct prompt's five blocks were stored by each worker, for its own request
    served_requests = {(link.trace_id, link.span_id) for s in backups for link in s.links}
    assert len(served_requests) == 3 and len(backups) == 3 * TP
    # requests 2 and 3 came without a trace context: their spans are roots of traces of their own
    roots = [requests[key] for key in served_requests if not requests[key].parent_span_id]
    assert len(roots) == 2
