"""vLLM's offline ``LLM`` serving prompts that carry a canary (:data:`CANARY_IDS`, a run of token ids), for the canary
test (:mod:`tests.vllm.test_token_ids`); our plugin is loaded by vLLM in each of its processes.

``python -m tests.vllm.canary_app MODEL --marker NAME=VALUE``: serves the prompts (token ids, and one as text), then,
while the engine's processes live, looks at every export process whose environment holds the marker (the test sets
it in this process's environment; each export process inherits its host's): its shared memory (the table, the
transfer ring and the id ring, read through ``/proc/<pid>/fd``), its ``environ`` and ``cmdline``, and whether user
``nobody`` can open that memory. Prints one JSON line: how many export processes it found, the bytes each one's id
ring was written, where the canary was found, and who could open the memory.
"""

from __future__ import annotations

import argparse
import json
import time
from array import array
from typing import Any

from tests.canary import NOBODY, Canary, export_processes, exporter_memfd, opens_as, proc_parts

#: The result line starts with this (vLLM logs to stdout too).
RESULT = "canary_app result: "
#: A run of token ids no prompt of the tests has (the tiny model's ``w905 w571 ...``: word ``wN`` is token ``N + 3``).
CANARY_IDS = [908, 574, 860, 98, 730, 386, 26, 638]
CANARY_TEXT = " ".join(f"w{i - 3}" for i in CANARY_IDS)
#: The canary as raw ids (int64 and int32, either way round), as decimals (a list's repr, a tensor's, a join) and as
#: the prompt's text.
CANARY = Canary(
    (
        array("q", CANARY_IDS).tobytes(),
        array("i", CANARY_IDS).tobytes(),
        array("q", CANARY_IDS).tobytes()[::-1],
        ", ".join(map(str, CANARY_IDS)).encode(),
        ",".join(map(str, CANARY_IDS)).encode(),
        " ".join(map(str, CANARY_IDS)).encode(),
        CANARY_TEXT.encode(),
    )
)
#: Eight documents of three blocks, each prompt one of them after the canary, so the prefix cache has hits to model.
DOCUMENT_TOKENS = 96


def prompts(count: int) -> list[list[int]]:
    documents = [[3 + (d * 131 + i * 17) % 997 for i in range(DOCUMENT_TOKENS)] for d in range(8)]
    return [CANARY_IDS + documents[(i * 5) % 8] for i in range(count)]


def inspect(marker: bytes, timeout_s: float = 30) -> dict[str, Any]:
    """The export processes of this run, once each has read its id ring (or ``timeout_s`` passed)."""
    from otel_hicache._internal.shared.ids import ARENA_BYTES, READ, WRITE, IdRing, region_bytes

    deadline = time.monotonic() + timeout_s
    while True:
        paths = {pid: exporter_memfd(pid) for pid in export_processes(marker)}
        memory = {pid: open(path, "rb").read() for pid, path in paths.items()}
        cursors = {}
        for pid, data in memory.items():
            ring = IdRing(memoryview(bytearray(data[-region_bytes(ARENA_BYTES) :])))
            cursors[pid] = (int(ring.ints[WRITE]), int(ring.ints[READ]))
            ring.release()
        read = all(write == read for write, read in cursors.values())
        if (paths and read and any(write for write, _ in cursors.values())) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    places = [f"memory of {pid}" for pid, data in memory.items() if CANARY.found_in(data)]
    places += [f"environ or cmdline of {pid}" for pid in paths if CANARY.found_in(proc_parts(pid))]
    return {
        "exporters": len(paths),
        "ring_written": [write for write, _ in cursors.values()],
        "canary_in": places,
        "we_open": all(opens_as(path, None) for path in paths.values()),
        "nobody_opens": any(opens_as(path, NOBODY) for path in paths.values()),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--marker", required=True, help="NAME=VALUE in this process's environment")
    parser.add_argument("--requests", type=int, default=24)
    args = parser.parse_args()

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from otel_hicache.testing.vllm import engine_arguments

    llm = LLM(**engine_arguments(args.model, cpu_chunks=16), disable_log_stats=False)
    greedy = SamplingParams(max_tokens=2, temperature=0)
    for ids in prompts(args.requests):  # one at a time: each admission looks up what the last one left
        llm.generate([TokensPrompt(prompt_token_ids=ids)], greedy, use_tqdm=False)
    llm.generate([CANARY_TEXT + " w1 w2"], greedy, use_tqdm=False)
    found = inspect(args.marker.encode())
    print(RESULT + json.dumps(found), flush=True)
    llm.llm_engine.engine_core.shutdown()  # its processes export their last window as they end


if __name__ == "__main__":
    main()
