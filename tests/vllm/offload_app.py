"""A vLLM process that offloads KV, instrumented only by what vLLM loads itself: its general plugins.

``python -m tests.vllm.offload_app [--rank R --tp T] [--seconds S]``: loads vLLM's ``vllm.general_plugins`` (as every
vLLM process does at start), then runs the offloading workload of :mod:`tests.vllm.support` through vLLM's real
connector as worker rank ``R`` of a ``T``-way tensor-parallel engine, once or repeatedly for ``S`` seconds, and prints
vLLM's own offloading stats (``OffloadingConnectorStats.reduce()``, summed over the run) as one JSON line.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter

from vllm.plugins import load_general_plugins

from tests.vllm import support


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--seconds", type=float, default=0.0)
    args = parser.parse_args()
    load_general_plugins()
    totals: Counter[str] = Counter()
    deadline = time.monotonic() + args.seconds
    round_ = 0
    while True:
        engine = support.engine(rank=args.rank, tp=args.tp)
        support.run_workload(engine, prefix=str(round_))
        totals.update(engine.vllm_stats())
        round_ += 1
        if time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    print(json.dumps(dict(totals)), flush=True)


if __name__ == "__main__":
    main()
