"""vLLM's offline ``LLM`` on the tiny model of :mod:`otel_hicache.testing.vllm`, its CPU tier the host-copy spec,
running a scripted workload; our plugin is loaded by vLLM itself in each of its processes (this one, the engine core,
the worker).

``python -m tests.vllm.offline_app MODEL --cpu-chunks N --requests 1,2,3,1 [--storage-dir DIR]``: one request at a
time, each the prompt of that seed (:func:`otel_hicache.testing.vllm.prompt`), 4 greedy tokens; then two one-token
requests, so the engine steps that submit and finish the last prompt's stores (vLLM defers a store to the next step).
``--storage-dir``: vLLM's filesystem tier there, behind the CPU tier (vLLM's tiering). Prints one JSON line: this
process's pid, each request's ``num_cached_tokens``, text and ``time.monotonic()`` span (the host's clock, which
every process shares), and vLLM's own metrics as its stat loggers hold them
(``prometheus_client.REGISTRY``, ``name{labels}`` -> value; ``LLM.get_metrics()`` would truncate counters to int).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

#: The line that carries the result starts with this (vLLM logs to stdout too).
RESULT = "offline_app result: "


def result(stdout: str) -> dict[str, Any]:
    """The result line of the app's ``stdout``."""
    (line,) = [line for line in stdout.splitlines() if line.startswith(RESULT)]
    parsed: dict[str, Any] = json.loads(line[len(RESULT) :])
    return parsed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--cpu-chunks", type=int, required=True)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--requests", required=True, help="comma-separated prompt seeds, run one after another")
    parser.add_argument("--storage-dir", help="vLLM's filesystem tier there, behind the CPU tier")
    args = parser.parse_args()

    import prometheus_client
    from vllm import LLM, SamplingParams

    from otel_hicache.testing.vllm import engine_arguments, prompt
    from tests.vllm.engine import parse_prometheus

    arguments = engine_arguments(args.model, args.cpu_chunks, args.tp, storage_dir=args.storage_dir)
    llm = LLM(**arguments, disable_log_stats=False)
    greedy = SamplingParams(max_tokens=4, temperature=0)
    requests = []
    for seed in (int(s) for s in args.requests.split(",")):
        start = time.monotonic()
        (out,) = llm.generate([prompt(seed)], greedy, use_tqdm=False)
        requests.append(
            {
                "seed": seed,
                "cached": out.num_cached_tokens,
                "text": out.outputs[0].text,
                "start": start,
                "end": time.monotonic(),
            }
        )
    for word in ("w1", "w2"):
        llm.generate([word], SamplingParams(max_tokens=1), use_tqdm=False)
    metrics = parse_prometheus(prometheus_client.generate_latest().decode())
    print(RESULT + json.dumps({"pid": os.getpid(), "requests": requests, "metrics": metrics}), flush=True)


if __name__ == "__main__":
    main()
