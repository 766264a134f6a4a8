"""Where a prompt's token ids go on a real vLLM engine exporting over OTLP: nowhere of ours.

vLLM's offline ``LLM`` (main, engine-core and worker processes, our plugin loaded in each) serves prompts that carry a
canary, a run of token ids (:mod:`tests.vllm.canary_app`), given as token ids and once as text. The engine core's
capacity lookups go to its export process as vLLM's block hashes, through the id ring, and the curve is exported (so
the lookups did reach the estimator there); yet the canary - as int64 or int32 ids, as decimals, as the prompt's text -
is in none of: the OTLP requests the receiver got (traces and metrics, headers included), any line any of the
engine's processes wrote (ours relayed into their logging among them), every export process's shared memory (table,
transfer ring and id ring, read while they live) and their ``/proc/<pid>/environ`` and ``cmdline``. Another user
cannot open that memory.
"""

from __future__ import annotations

import json
import os
import uuid
from array import array
from pathlib import Path
from typing import Any

import pytest

from otel_hicache import semconv as sc
from otel_hicache.testing.otlp_receiver import OtlpReceiver
from otel_hicache.testing.vllm import environment
from tests.vllm.canary_app import CANARY, RESULT, prompts
from tests.vllm.engine import Exported, needs_cpu_build, otlp_environment, run_offline

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900), needs_cpu_build]


@pytest.mark.skipif(os.geteuid() != 0, reason="needs to start a process as another user")
def test_token_ids_reach_no_process_message_or_memory_of_ours(tiny_model: Path) -> None:
    marker = f"HICACHE_CANARY_RUN={uuid.uuid4().hex}"  # an export process has its host's environment, less OTEL_*
    name, value = marker.split("=")
    with OtlpReceiver() as receiver:
        env = environment(**otlp_environment(receiver, "vllm-canary"), **{name: value})
        output = run_offline(tiny_model, env, "--marker", marker, module="tests.vllm.canary_app")
        exported = Exported(receiver)
        assert exported.wait(lambda: bool(exported.latest(sc.METRIC_CAPACITY_HIT_RATIO)), timeout_s=60)
        requests: list[Any] = [*receiver.trace_requests, *receiver.metric_requests]
        otlp = b"".join(r.SerializeToString() for r in requests)
        headers = repr(receiver.headers).encode()
    (line,) = [line for line in output.splitlines() if line.startswith(RESULT)]
    found = json.loads(line[len(RESULT) :])

    assert CANARY.found_in(array("q", prompts(1)[0]).tobytes())  # the probe finds a raw copy of a prompt's ids
    assert found["exporters"] >= 1 and max(found["ring_written"]) > 0, found  # the block hashes took the id ring
    assert receiver.spans(), "transfers were exported as spans"
    assert not CANARY.found_in(otlp + headers)
    assert not CANARY.found_in(output.replace(line, "").encode()), "no line of any of the engine's processes"
    assert found["canary_in"] == [], "no export process's memory, environ or cmdline"
    assert (found["we_open"], found["nobody_opens"]) == (True, False), "our user opens the memory, another cannot"
