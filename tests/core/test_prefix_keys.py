"""A prompt's page keys: equal exactly when the prefixes are, whichever way they were computed.

Small pages (SGLang's default is one token) are keyed by a linear chain, per page in Python for a short prompt and
with numpy for a long one; the estimator samples the numpy keys with numpy too. A prompt's keys are the first keys of
every longer prompt it prefixes, so both ways must give the same keys and the same sampling hashes, to the bit.
"""

from __future__ import annotations

import random
import sys
import threading
import time
from array import array
from collections.abc import Callable, Iterable

import numpy  # loaded: page_keys uses numpy only where the process has imported it
import pytest

from otel_hicache.capacity import CapacityModel, page_keys
from otel_hicache.prefix_keys import SMALL_PAGE_TOKENS, VECTOR_PAGES, VECTOR_PIECE, VectorKeys, _linear_chain

#: Past the 64-bit signed range of the sampling hashes: every page is sampled.
EVERY_PAGE = 1 << 63


def prompt(pages: int, page_tokens: int, seed: int = 1, extra: int = 0) -> array[int]:
    rng = random.Random(seed)
    return array("q", (rng.randrange(1 << 20) for _ in range(pages * page_tokens + extra)))


class TestSmallPages:
    @pytest.mark.parametrize("page_tokens", [1, 2, 7])
    @pytest.mark.parametrize("seed", [0, -5, hash(("extra", "salt")), (1 << 70) + 3])
    def test_a_long_prompt_keyed_by_numpy_begins_with_the_keys_of_each_short_prompt_it_extends(
        self, page_tokens: int, seed: int
    ) -> None:
        tokens = prompt(2 * VECTOR_PIECE + 5, page_tokens, extra=page_tokens - 1)  # three pieces, a partial page
        long = page_keys(tokens, page_tokens, seed)
        assert isinstance(long, VectorKeys)
        keys = list(long)
        assert len(keys) == 2 * VECTOR_PIECE + 5
        for pages in (1, 2, VECTOR_PAGES - 1):
            short = page_keys(tokens[: pages * page_tokens], page_tokens, seed)
            assert not isinstance(short, VectorKeys)
            assert list(short) == keys[:pages]
        partial = tokens[: VECTOR_PIECE * page_tokens + page_tokens - 1]  # a piece of pages and a partial one
        assert list(page_keys(partial, page_tokens, seed)) == keys[:VECTOR_PIECE]

    def test_prompts_that_differ_in_one_page_share_the_keys_before_it_and_none_after(self) -> None:
        tokens = prompt(3 * VECTOR_PAGES, 1)
        other = array("q", tokens)
        other[VECTOR_PAGES] += 1
        mine, theirs = list(page_keys(tokens, 1)), list(page_keys(other, 1))
        assert mine[:VECTOR_PAGES] == theirs[:VECTOR_PAGES]
        assert not set(mine[VECTOR_PAGES:]) & set(theirs[VECTOR_PAGES:])

    @pytest.mark.parametrize("typecode", ["q", "l", "i", "Q", "H", "b"])
    def test_an_arrays_ids_are_copied_so_the_engine_may_still_resize_it(self, typecode: str) -> None:
        tokens = array(typecode, (i % 100 for i in prompt(VECTOR_PAGES, 1)))
        keys = page_keys(tokens, 1)
        assert isinstance(keys, VectorKeys)
        tokens.append(5)  # an array exporting its buffer (a view) would raise BufferError here, on the engine's thread
        assert list(keys) == list(_linear_chain(tokens[:VECTOR_PAGES], 1, 0))

    def test_an_engine_thread_resizing_its_array_meanwhile_never_fails(self) -> None:
        """numpy reading an array exports its buffer and lets go of the GIL for a long copy: a resize on the engine's
        thread meanwhile would raise BufferError there. The ids are copied by the array itself."""
        tokens, errors, stop = array("i", range(4 * VECTOR_PIECE)), [], threading.Event()

        def engine() -> None:
            while not stop.is_set():
                try:
                    tokens.append(1)
                    tokens.pop()
                except BufferError as exc:
                    errors.append(exc)

        interval = sys.getswitchinterval()
        sys.setswitchinterval(1e-6)  # hand the GIL over as often as it can be
        thread = threading.Thread(target=engine)
        thread.start()
        try:
            deadline = time.monotonic() + 0.5
            while time.monotonic() < deadline:
                page_keys(tokens, 1)
        finally:
            stop.set()
            thread.join()
            sys.setswitchinterval(interval)
        assert not errors

    @pytest.mark.parametrize(
        "make",
        [
            lambda: (t for t in range(VECTOR_PAGES)),  # any iterable: keyed one page at a time, as before
            lambda: array("d", range(VECTOR_PAGES)),  # floats: Python hashes them as floats
            lambda: range(VECTOR_PAGES),
            lambda: numpy.arange(VECTOR_PAGES),
            lambda: type("Ids", (list,), {})(range(VECTOR_PAGES)),  # a subclass may mean other ids to numpy
        ],
        ids=["generator", "float array", "range", "ndarray", "list subclass"],
    )
    def test_other_prompts_are_keyed_one_page_at_a_time(self, make: Callable[[], Iterable[int]]) -> None:
        keys = page_keys(make(), 1)  # type: ignore[arg-type]  # an engine's prompt need not be a sequence
        assert not isinstance(keys, VectorKeys)
        assert list(keys) == list(_linear_chain(make(), 1, 0))  # type: ignore[arg-type]

    @pytest.mark.parametrize("page_tokens", [0, True, numpy.int8(3)])
    def test_odd_page_sizes_are_keyed_one_page_at_a_time(self, page_tokens: int) -> None:
        tokens = prompt(3 * VECTOR_PAGES, 3)
        keys = page_keys(tokens, page_tokens)
        assert not isinstance(keys, VectorKeys)
        assert list(keys) == list(_linear_chain(tokens, page_tokens, 0))

    def test_a_seed_is_a_namespace(self) -> None:
        tokens = prompt(VECTOR_PAGES, 1)
        assert not set(page_keys(tokens, 1, 1)) & set(page_keys(tokens, 1, 2))

    @pytest.mark.parametrize("threshold", [EVERY_PAGE, 0, -(1 << 62), 12_345])
    def test_the_numpy_sampling_hashes_are_pythons_hash_of_each_key(self, threshold: int) -> None:
        keys = page_keys(prompt(VECTOR_PIECE + 300, 1), 1)
        assert isinstance(keys, VectorKeys)
        paces = []
        looked, sampled = keys.sampled(threshold, VECTOR_PIECE + 200, lambda: paces.append(1))
        assert looked == VECTOR_PIECE + 200
        assert sampled == [h for h in (hash((key,)) for key in list(keys)[:looked]) if h < threshold]
        assert len(paces) == 1  # between the two pieces

    @pytest.mark.parametrize("odd", [-3, (1 << 61) - 1, (1 << 62), 1 << 70, 2.5])
    def test_ids_python_hashes_to_another_value_are_keyed_per_page(self, odd: float) -> None:
        tokens: list[float] = list(prompt(2 * VECTOR_PAGES, 1))
        clean = page_keys(tokens, 1)  # type: ignore[arg-type]  # an engine's ids need not be ints
        assert isinstance(clean, VectorKeys)
        tokens[VECTOR_PAGES] = odd
        keys = page_keys(tokens, 1)  # type: ignore[arg-type]
        assert not isinstance(keys, VectorKeys)
        assert list(keys)[:VECTOR_PAGES] == list(clean)[:VECTOR_PAGES]

    def test_without_numpy_in_the_process_the_keys_are_the_same(self, monkeypatch: pytest.MonkeyPatch) -> None:
        tokens = prompt(VECTOR_PIECE, 2)
        with_numpy = list(page_keys(tokens, 2))
        monkeypatch.setitem(sys.modules, "numpy", None)  # as if no module had imported it: none is imported for it
        keys = page_keys(tokens, 2)
        assert not isinstance(keys, VectorKeys)
        assert list(keys) == with_numpy

    def test_the_model_predicts_the_same_from_numpy_keys_as_from_the_same_keys_listed(self) -> None:
        rng = random.Random(5)
        documents = [prompt(rng.randrange(VECTOR_PAGES, 3 * VECTOR_PAGES), 1, seed=d) for d in range(40)]
        fed, listed = CapacityModel(1, max_keys=512), CapacityModel(1, max_keys=512)  # the threshold drops
        for _ in range(300):
            tokens = documents[min(int(rng.paretovariate(1.0)) - 1, 39)]
            tokens = tokens[: rng.randrange(VECTOR_PAGES, len(tokens) + 1)]
            keys = page_keys(tokens, 1)
            assert isinstance(keys, VectorKeys)
            fed.access(keys, len(tokens))
            listed.access(list(keys), len(tokens))
        assert fed.threshold < EVERY_PAGE
        for pages in (1, 50, 500, 5000, float("inf")):
            assert fed.hit_ratio(pages) == listed.hit_ratio(pages), pages


def test_larger_pages_are_a_chain_of_python_hashes_of_each_page() -> None:
    tokens = prompt(VECTOR_PIECE, SMALL_PAGE_TOKENS)
    key, expected = 7, []
    for start in range(0, len(tokens), SMALL_PAGE_TOKENS):
        key = hash((key, tuple(tokens[start : start + SMALL_PAGE_TOKENS])))
        expected.append(key)
    assert list(page_keys(tokens, SMALL_PAGE_TOKENS, 7)) == expected
