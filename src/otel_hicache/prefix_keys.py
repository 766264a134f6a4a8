"""Page keys of a prompt for the capacity estimator: a chain of hashes, one per full page, each equal exactly when the
prefixes up to its page are (:func:`page_keys`).

Two chains, by page size, each the same whatever computes it:

* pages of :data:`SMALL_PAGE_TOKENS` tokens or more: ``key = hash((key, page))``, the page a tuple of its ids (C-level
  tuple building and hashing, ~20 ns a token);
* smaller pages (SGLang's default is one token): ``key = key * B + hash(page)`` modulo 2**64, shifted right 4 bits
  (60-bit keys: an int below 2**61 - 1 is its own Python hash). Per page, Python's price (~0.15 us) is what a one-token
  page costs, ~0.65 ms for a 4,096-token prompt with the estimator's sampling hash. The chain is linear, so a prompt of
  :data:`VECTOR_PAGES` pages or more is keyed with numpy (prefix sums over powers of ``B``), and its sampling hashes
  (Python's ``hash((key,))``, what :class:`~otel_hicache.capacity.CapacityModel` samples by) are computed the same
  way: ~70 us for 4,096 one-token pages. numpy is used only where the process has already imported it (every engine
  does): nothing is imported for it. Only a list, a tuple or an ``array.array`` of ints in ``[0, 2**61 - 1)`` (ints
  Python hashes to themselves) goes to numpy; any other prompt is keyed by the per-page chain (an ``int`` subclass
  with a ``__hash__`` of its own would be keyed by its value there).

The linear chain modulo 2**64 collides for some crafted prompts (Thue-Morse sequences of two pages' hashes, thousands of
pages long): two such prefixes would count as one page in the estimate, nothing else.
"""

from __future__ import annotations

import functools
import sys
from array import array
from collections.abc import Callable, Iterator, Sequence
from typing import Any

#: Pages smaller than this many tokens are keyed by the linear chain.
SMALL_PAGE_TOKENS = 8
#: Small-page prompts of at least this many pages are keyed by numpy (its fixed price is ~20 us, the per-page chain's
#: ~0.25 us a page).
VECTOR_PAGES = 96
#: Pages keyed by numpy at once: a longer prompt is keyed a piece at a time, paced between pieces (~70 us a piece).
VECTOR_PIECE = 4096

_M64 = (1 << 64) - 1
_M61 = (1 << 61) - 1  # Python hashes an int modulo this
_BASE = 0x9E3779B97F4A7C15  # odd: invertible modulo 2**64
_SHIFT = 4
# CPython's tuple hash (xxHash's rounds; Objects/tupleobject.c since 3.8), emulated with numpy for the sampling hash
_XX1, _XX2, _XX5 = 11400714785074694791, 14029467366897019727, 2870177450012600261
_XX_MINUS_ONE = 1546275796  # what a tuple hash of -1 becomes
_INT64_MAX = (1 << 63) - 1


def page_keys(tokens: Sequence[int], page_tokens: int, seed: int = 0) -> Iterator[int] | VectorKeys:
    """Keys of each full page of ``tokens`` (``seed``: a namespace, e.g. a hash of a cache salt), lazily: an iterator,
    or for a long small-page prompt a :class:`VectorKeys` (iterable too), which the estimator samples vectorised."""
    if page_tokens >= SMALL_PAGE_TOKENS:
        return _tuple_chain(tokens, page_tokens, seed)
    numpy = sys.modules.get("numpy")
    if (
        numpy is not None
        and type(page_tokens) is int
        and page_tokens > 0
        and type(tokens) in _VECTOR_TYPES  # not a subclass (of a list with an __array__ of its own, say)
        and len(tokens) // page_tokens >= VECTOR_PAGES
    ):
        ids = _as_int64(numpy, tokens)
        if ids is not None:
            return VectorKeys(numpy, ids, page_tokens, seed)
    return _linear_chain(tokens, page_tokens, seed)


def _tuple_chain(tokens: Sequence[int], page_tokens: int, key: int) -> Iterator[int]:
    pages = iter(tokens)
    for page in zip(*[pages] * page_tokens, strict=False):  # each full page as a tuple, the tail left out (C-level)
        key = hash((key, page))
        yield key


def _linear_chain(tokens: Sequence[int], page_tokens: int, seed: int) -> Iterator[int]:
    chain, base, mask = seed & _M64, _BASE, _M64
    pages = iter(tokens)
    for page in zip(*[pages] * page_tokens, strict=False):
        chain = (chain * base + hash(page)) & mask
        yield chain >> _SHIFT


#: What an engine holds a prompt in (SGLang: an ``array('q')``, once a list) and numpy copies without exporting a
#: buffer the engine may resize meanwhile; anything else is keyed one page at a time.
_VECTOR_TYPES = (list, tuple, array)


def _as_int64(numpy: Any, tokens: Sequence[int]) -> Any:
    """``tokens`` as an int64 array of our own, or None unless every id is an int Python hashes to itself (in
    ``[0, 2**61 - 1)``: not a float, not negative)."""
    if isinstance(tokens, array):
        if tokens.typecode not in "bBhHiIlLqQ":  # not ints (floats, unicode characters)
            return None
        # copied by the array itself (one memcpy, the GIL held), never viewed: numpy reading the array exports its
        # buffer (and lets go of the GIL for a long copy), and the engine resizing it meanwhile would raise
        # BufferError on its own thread
        signed = "i" if tokens.typecode.islower() else "u"
        ids = numpy.frombuffer(tokens.tobytes(), dtype=numpy.dtype(f"{signed}{tokens.itemsize}"))
    else:
        try:
            ids = numpy.array(tokens)  # from Python objects: the GIL held throughout
        except (TypeError, ValueError):
            return None
        if ids.ndim != 1 or ids.dtype.kind not in "biu":
            return None
    if len(ids) and (ids.min() < 0 or ids.max() >= _M61):
        return None
    return ids.astype(numpy.int64, copy=False)


class VectorKeys:
    """The linear chain's keys of a long small-page prompt, computed with numpy a piece at a time: iterate it for the
    keys, or :meth:`sampled` for the sampling hashes below a threshold, as the estimator does."""

    __slots__ = ("_ids", "_np", "_page_tokens", "_seed")

    def __init__(self, numpy: Any, ids: Any, page_tokens: int, seed: int) -> None:
        self._np, self._ids, self._page_tokens, self._seed = numpy, ids, page_tokens, seed & _M64

    def __len__(self) -> int:
        return len(self._ids) // self._page_tokens

    def __iter__(self) -> Iterator[int]:
        for keys in self._pieces(len(self), unpaced):
            yield from keys.tolist()

    def sampled(self, threshold: int, pages: int, pace: Callable[[], None]) -> tuple[int, list[int]]:
        """``(pages keyed, the sampling hashes below threshold, in page order)`` of at most ``pages`` pages: the
        hashes ``[hash((key,)) for key in self][:pages]`` keeps, ``pace`` called between pieces."""
        np, out, looked = self._np, [], 0
        below = None if threshold > _INT64_MAX else np.int64(threshold)
        for keys in self._pieces(pages, pace):
            looked += len(keys)
            hashes = _tuple_hash(np, (keys,)).view(np.int64)
            out += (hashes if below is None else hashes[hashes < below]).tolist()
        return looked, out

    def _pieces(self, pages: int, pace: Callable[[], None]) -> Iterator[Any]:
        """The keys (uint64 arrays) of the first ``pages`` pages, :data:`VECTOR_PIECE` at a time."""
        np, width = self._np, self._page_tokens
        pages = min(pages, len(self))
        grid = self._ids[: pages * width].view(np.uint64).reshape(pages, width)
        powers, inverses = _powers(np)
        chain = np.uint64(self._seed)
        for start in range(0, pages, VECTOR_PIECE):
            if start:
                pace()
            rows = grid[start : start + VECTOR_PIECE]
            n = len(rows)
            # chain_i = B**i * (chain_0 + sum_{j <= i} hash(page_j) * B**-j): the recurrence as one prefix sum
            sums = np.cumsum(_tuple_hash(np, rows.T) * inverses[1 : n + 1], dtype=np.uint64)
            sums += chain
            chains = sums * powers[1 : n + 1]
            chain = chains[-1]
            yield chains >> np.uint64(_SHIFT)


def _tuple_hash(np: Any, lanes: Any) -> Any:
    """Python's ``hash`` of each row's tuple as uint64, ``lanes`` its columns (uint64 arrays of ints below
    ``2**61 - 1``: each is its own hash)."""
    acc = np.full(len(lanes[0]), _XX5, dtype=np.uint64)
    for lane in lanes:
        acc += lane * np.uint64(_XX2)
        acc = (acc << np.uint64(31)) | (acc >> np.uint64(33))
        acc *= np.uint64(_XX1)
    acc += np.uint64(len(lanes) ^ (_XX5 ^ 3527539))
    acc[acc == np.uint64(_M64)] = np.uint64(_XX_MINUS_ONE)
    return acc


@functools.cache
def _powers(np: Any) -> tuple[Any, Any]:
    """``B**k`` and ``B**-k`` modulo 2**64 for k up to :data:`VECTOR_PIECE` (uint64 products wrap), made once."""
    return tuple(
        np.concatenate(([np.uint64(1)], np.cumprod(np.full(VECTOR_PIECE, base, dtype=np.uint64), dtype=np.uint64)))
        for base in (_BASE, pow(_BASE, -1, 1 << 64))
    )


def unpaced() -> None:
    """The pace of work that never pauses (keys iterated, a model used directly, not on a host thread)."""
