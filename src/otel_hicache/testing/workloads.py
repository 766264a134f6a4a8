"""Seeded prompt workloads with a spread of reuse distances, for checking capacity predictions by re-running.

Each generator yields prompts (token id lists) forever, the same ones for the same arguments, and fits any engine:
``vocab`` bounds the ids (a real model's vocabulary), ``scale`` multiplies every length (an engine with bigger pages
or blocks needs longer prompts for the same reuse pattern in pages). Take as many as a run needs::

    >>> import itertools
    >>> prompts = list(itertools.islice(chats(seed=7), 3))
    >>> [len(p) for p in prompts] == [len(p) for p in itertools.islice(chats(seed=7), 3)]
    True

* :func:`chats`: multi-turn conversations over a few shared system prompts, interleaved: short distances (the next
  turn), long ones (a resumed conversation) and a hot shared prefix.
* :func:`documents`: questions over documents whose popularity is Zipf-distributed: a smooth curve of distances.
* :func:`scan`: documents asked about in a fixed cycle, the pattern that defeats LRU: no hit until the tier holds the
  whole cycle, then every one.

:data:`WORKLOADS` names them (the ground-truth tests run each).
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Iterator


def chats(
    seed: int = 0,
    *,
    vocab: int = 32_000,
    scale: int = 1,
    system_prompts: int = 3,
    system_tokens: int = 96,
    turns: tuple[int, int] = (2, 8),
    turn_tokens: tuple[int, int] = (16, 64),
    active: int = 12,
) -> Iterator[list[int]]:
    """Conversations of ``turns`` turns over one of ``system_prompts`` shared system prompts, ``active`` at a time:
    each request is the whole conversation so far."""
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n * scale)]

    systems = [tokens(system_tokens) for _ in range(system_prompts)]

    def conversation() -> Iterator[list[int]]:
        history = list(rng.choice(systems))
        for _ in range(rng.randint(*turns)):
            history += tokens(rng.randint(*turn_tokens))
            yield history
            history = history + tokens(rng.randint(*turn_tokens))  # the reply

    live = [conversation() for _ in range(active)]
    while True:
        i = rng.randrange(active)
        prompt = next(live[i], None)
        if prompt is None:
            live[i] = conversation()
            continue
        yield prompt


def documents(
    seed: int = 0,
    *,
    vocab: int = 32_000,
    scale: int = 1,
    count: int = 48,
    document_tokens: tuple[int, int] = (64, 320),
    skew: float = 0.9,
    question_tokens: tuple[int, int] = (8, 40),
) -> Iterator[list[int]]:
    """A question (new tokens) after one of ``count`` documents drawn with Zipf weights ``1 / rank**skew``."""
    rng = random.Random(seed)
    docs = [[rng.randrange(vocab) for _ in range(rng.randint(*document_tokens) * scale)] for _ in range(count)]
    weights = [1.0 / (rank + 1) ** skew for rank in range(count)]
    while True:
        doc = rng.choices(docs, weights)[0]
        yield doc + [rng.randrange(vocab) for _ in range(rng.randint(*question_tokens) * scale)]


def scan(
    seed: int = 0,
    *,
    vocab: int = 32_000,
    scale: int = 1,
    count: int = 12,
    document_tokens: int = 160,
    question_tokens: int = 8,
) -> Iterator[list[int]]:
    """A question after each of ``count`` documents in turn, over and over."""
    rng = random.Random(seed)
    docs = [[rng.randrange(vocab) for _ in range(document_tokens * scale)] for _ in range(count)]
    for doc in itertools.cycle(docs):
        yield doc + [rng.randrange(vocab) for _ in range(question_tokens * scale)]


WORKLOADS: dict[str, Callable[..., Iterator[list[int]]]] = {"chats": chats, "documents": documents, "scan": scan}
