"""One seeded workload served by vLLM's offline ``LLM`` at several tier sizes, one engine after another in this
process (each a real engine: its own engine-core and worker processes, our plugin loaded by vLLM in each), for the
capacity test (:mod:`tests.vllm.test_capacity`).

``python -m tests.vllm.capacity_app MODEL --requests N --runs today:129:256,device-0.5:65:256,...``: each run is
``label:GPU blocks:CPU chunks``; its engine core exports under the service name ``$OTEL_SERVICE_NAME-label``. The
workload interleaves capacity's three generators (:mod:`otel_hicache.testing.workloads`: chats, documents, a scan),
one word per token; vLLM admits one request at a time (``max_num_seqs=1``), so each admission's lookup sees the
whole cache. Prints one JSON line per run: its label and vLLM's own prompt-token counters by source (as its stat
loggers hold them: ``prometheus_client.REGISTRY``, reset with each engine).
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import random
from collections.abc import Iterator

#: Each run's result line starts with this (vLLM logs to stdout too).
RESULT = "capacity_app run: "
#: The tiny model's words (``w0`` ... ``w996``: one token each) and its longest request.
VOCAB = 997
MAX_MODEL_LEN = 1024


def results(stdout: str) -> list[dict[str, object]]:
    """The result lines of the app's ``stdout``, in run order."""
    return [json.loads(line[len(RESULT) :]) for line in stdout.splitlines() if line.startswith(RESULT)]


def workload(seed: int) -> Iterator[list[int]]:
    """Chats, documents and a scan interleaved at random (seeded), each prompt under :data:`MAX_MODEL_LEN`."""
    from otel_hicache.testing.workloads import chats, documents, scan

    streams = [
        chats(seed, vocab=VOCAB, active=8, turns=(2, 5)),
        documents(seed, vocab=VOCAB, count=32),
        scan(seed, vocab=VOCAB, count=12),
    ]
    rng = random.Random(seed)
    while True:
        yield next(rng.choice(streams))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--requests", type=int, required=True)
    parser.add_argument("--runs", required=True, help="comma-separated label:gpu_blocks:cpu_chunks")
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()

    import prometheus_client
    from vllm import LLM, SamplingParams

    from tests.vllm.engine import engine_arguments, parse_prometheus, vllm_total

    prompts = [" ".join(f"w{t}" for t in p) for p in itertools.islice(workload(args.seed), args.requests)]
    service = os.environ.get("OTEL_SERVICE_NAME", "vllm")
    for run in args.runs.split(","):
        label, gpu_blocks, cpu_chunks = run.split(":")
        os.environ["OTEL_SERVICE_NAME"] = f"{service}-{label}"  # the engine's processes inherit it at their start
        arguments = engine_arguments(args.model, int(cpu_chunks))
        arguments.update(num_gpu_blocks_override=int(gpu_blocks), max_model_len=MAX_MODEL_LEN, max_num_seqs=1)
        llm = LLM(**arguments, disable_log_stats=False)
        llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
        metrics = parse_prometheus(prometheus_client.generate_latest().decode())
        by_source = {
            source: vllm_total(metrics, "vllm:prompt_tokens_by_source_total", source=source)
            for source in ("local_compute", "local_cache_hit", "external_kv_transfer")
        }
        print(RESULT + json.dumps({"label": label, "by_source": by_source}), flush=True)
        llm.llm_engine.engine_core.shutdown()  # its processes export their last window as they end
        del llm
        gc.collect()


if __name__ == "__main__":
    main()
