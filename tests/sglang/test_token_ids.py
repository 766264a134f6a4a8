"""Where a prompt's token ids go when a scheduler exports over OTLP: to the export process, through the id ring alone.

Prompts carrying a canary token id (a recognisable 8-byte value) are admitted through SGLang's real classes,
instrumented, exporting over OTLP into the in-process receiver (the export process of
:func:`otel_hicache.sdk.configure`). The curve is exported (so the ids did reach the estimator), yet the canary - its
bytes either way round, its decimal and its hexadecimal spelling - is in none of: the OTLP requests the receiver got
(traces and metrics, headers included), any log line of the host or of the export process (relayed into the host's
logging), either process's ``/proc/<pid>/environ`` and ``cmdline``, the shared table outside the id ring, and the id
ring itself once the export process has read it (it zeroes what it read). Another user cannot open the shared memory
through ``/proc/<pid>/fd/N``.
"""

from __future__ import annotations

import itertools
import logging
import os
from array import array
from typing import Any

import pytest

pytest.importorskip("sglang")

from otel_hicache import semconv as sc
from otel_hicache._internal.shared.channel import EXPORTER_PID
from otel_hicache._internal.shared.ids import WRITE
from otel_hicache.testing.sglang_serving import Served
from otel_hicache.testing.workloads import documents
from tests.canary import NOBODY, Canary, exporter_memfd, opens_as, proc_parts

pytestmark = pytest.mark.sglang

CANARY = 0x5EC2_E7CA_4A21_D1E5  # a token id no vocabulary has, and no counter, size or time would read
SPELLINGS = Canary(  # the canary's bytes either way round, its decimal and its hexadecimal spelling
    (
        CANARY.to_bytes(8, "little"),
        CANARY.to_bytes(8, "big"),
        str(CANARY).encode(),
        f"{CANARY:x}".encode(),
    )
)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs to start a process as another user")
def test_token_ids_reach_the_export_process_through_the_id_ring_alone(
    cpu_sglang: Any, caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]
) -> None:
    from otel_hicache.integrations.sglang import SGLangHiCacheInstrumentor
    from otel_hicache.sdk import configure
    from otel_hicache.testing.otlp_receiver import OtlpReceiver

    caplog.set_level(logging.DEBUG)
    prompts = [[CANARY, *prompt, CANARY] for prompt in itertools.islice(documents(seed=3, count=24), 120)]
    with OtlpReceiver() as receiver:
        setup = configure(endpoint=receiver.grpc_endpoint, protocol="grpc", service_name="canary", env={})
        instrumentor = SGLangHiCacheInstrumentor()
        instrumentor.instrument(telemetry=setup.telemetry, stat_loggers=False)
        try:
            served = Served("write_through", 4096, 8192, page_size=16)
            try:
                served.serve(prompts)
                setup.force_flush()
                assert receiver.wait_for(lambda: receiver.latest_metric(sc.METRIC_CAPACITY_HIT_RATIO) is not None, 30)
                channel = setup.telemetry._host.channel
                assert channel.ids is not None
                pid = int(channel.ints[EXPORTER_PID])
                written = int(channel.ids.ints[WRITE])
                processes = {os.getpid(), pid}
                proc = b"".join(map(proc_parts, processes))
                memory = bytes(channel.bytes)
                memfd = exporter_memfd(pid)
                readable = opens_as(memfd, None), opens_as(memfd, NOBODY)
            finally:
                served.close()
        finally:
            instrumentor.uninstrument()
            setup.shutdown()
        requests: list[Any] = [*receiver.trace_requests, *receiver.metric_requests]
        otlp = b"".join(r.SerializeToString() for r in requests)
        headers = repr(receiver.headers).encode()
    logs = "\n".join(record.getMessage() for record in caplog.records).encode()
    out, err = capfd.readouterr()

    assert SPELLINGS.found_in(array("q", prompts[0]).tobytes())  # the probe finds a raw copy of a prompt's ids
    assert written > 0, "the ids went through the id ring"
    assert receiver.spans(), "transfers were exported as spans"
    assert not SPELLINGS.found_in(otlp + headers)
    assert not SPELLINGS.found_in(logs + out.encode() + err.encode())
    assert not SPELLINGS.found_in(proc)
    assert not SPELLINGS.found_in(memory), "neither the table nor the id ring (read, so zeroed) holds an id"
    assert readable == (True, False), "our user opens the shared memory, another one cannot"
