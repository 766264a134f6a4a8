"""Deterministic multi-turn chat workload: shared system prompts, shared documents, growing histories.

Every request is the whole conversation so far (system prompt + document + turns), so consecutive turns of a
conversation hit the device, conversations resumed after a while hit the host, and popular documents that were
pushed out of host memory come back from storage. Same seed, same token lists.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class WorkloadConfig:
    seed: int = 0
    vocab: int = 32_000
    system_prompts: int = 3
    system_tokens: int = 64
    documents: int = 16
    document_tokens: int = 256
    document_skew: float = 1.2  # Zipf exponent: a few documents are popular
    turns: tuple[int, int] = (2, 6)  # per conversation, inclusive
    turn_tokens: tuple[int, int] = (8, 48)  # per user message and per reply
    active: int = 6  # conversations interleaved at any time


def requests(config: WorkloadConfig = WorkloadConfig()) -> Iterator[list[int]]:
    """An endless stream of prompts (token id lists)."""
    rng = random.Random(config.seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(config.vocab) for _ in range(n)]

    systems = [tokens(config.system_tokens) for _ in range(config.system_prompts)]
    documents = [tokens(config.document_tokens) for _ in range(config.documents)]
    weights = [1.0 / (rank + 1) ** config.document_skew for rank in range(config.documents)]

    def conversation() -> Iterator[list[int]]:
        history = rng.choice(systems) + rng.choices(documents, weights)[0]
        for _ in range(rng.randint(*config.turns)):
            history = history + tokens(rng.randint(*config.turn_tokens))
            yield history
            history = history + tokens(rng.randint(*config.turn_tokens))

    active = [conversation() for _ in range(config.active)]
    while True:
        i = rng.randrange(len(active))
        prompt = next(active[i], None)
        if prompt is None:
            active[i] = conversation()
            continue
        yield prompt
