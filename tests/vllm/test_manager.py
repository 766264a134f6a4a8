"""vLLM's CPU-tier manager as vLLM >= 0.33 shapes it: the capacity it states (``config_info()``, its
``vllm:kv_offload_config_info`` series) is our ``hicache.pool.limit``, and its ``lock`` - which vLLM's scheduler
holds across a whole step - is never taken by us, nor needed to read the tier."""

from __future__ import annotations

import dataclasses
import logging
import sys
import threading
from types import TracebackType
from typing import Any

import pytest
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

from otel_hicache.testing.sdk import Sdk
from tests.vllm import stepping, support

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(
        not hasattr(CPUOffloadingManager, "config_info"), reason="vLLM < 0.33: no manager lock, no stated capacity"
    ),
]

HOST = {"hicache.tier": "host", "hicache.pool": "kv"}
MISMATCH = "otel_hicache.engine.mismatch"


class RecordingLock:
    """A real lock, as a manager entered from more than one thread supplies; it notes which module entered it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.takers: list[str] = []

    def __enter__(self) -> None:
        frame = sys._getframe(1)
        while frame.f_globals.get("__name__") == "contextlib":  # vLLM enters it through an ExitStack
            frame = frame.f_back  # type: ignore[assignment]
        self.takers.append(str(frame.f_globals.get("__name__")))
        assert self._lock.acquire(timeout=5), "entered while held: a second taker on the same thread"

    def __exit__(self, *exc: tuple[type[BaseException] | None, BaseException | None, TracebackType | None]) -> None:
        self._lock.release()


class LockedManager(CPUOffloadingManager):
    """vLLM's CPU manager with a real lock (its base's default is a no-op)."""

    recording: RecordingLock

    @property
    def lock(self) -> Any:
        return self.recording


class LockedSpec(support.HostCopySpec):
    """The host-copy spec whose manager has a real lock."""

    def get_manager(self) -> Any:
        manager = super().get_manager()
        if type(manager) is CPUOffloadingManager:
            manager.__class__ = LockedManager
            manager.recording = RecordingLock()
        return manager


def test_the_managers_lock_is_taken_by_vllm_only_and_the_tier_reads_without_it(instrumented: Sdk) -> None:
    page = support.ATTENTION.page_size_bytes * len(support.LAYERS)
    engine = stepping.stepper(
        cpu_chunks=6, spec_name="LockedSpec", spec_module_path=__name__, sync_load_budget_bytes=64 * page
    )
    manager = engine.connector.manager
    assert isinstance(manager, LockedManager)
    for seed in (1, 2, 3):  # 12 blocks into a 6-chunk tier: evictions
        engine.add(f"r{seed}", stepping.prompt(seed, 4))
        engine.run()
    assert engine.scheduler.kv_cache_manager.reset_prefix_cache()
    engine.add("again", [*stepping.prompt(3, 4), 7])  # a sync load back from the tier
    engine.run()

    takers = manager.recording.takers
    assert takers and {t.split(".")[0] for t in takers} == {"vllm"}
    assert len(instrumented.spans("hicache.load_back")) == 1
    assert sum(n for (tier, _), n in instrumented.counters()["hicache.eviction.tokens"].items() if tier == "host") > 0
    with manager.lock:  # held, as during a step: the tier is read all the same (a second taker would fail)
        assert instrumented.value("hicache.pool.limit", HOST) == 6 * support.BLOCK_SIZE
        assert instrumented.value("hicache.pool.usage", {**HOST, "hicache.slot.state": "used"}) > 0


def test_the_capacity_vllm_states_in_kv_offload_config_info_is_our_pool_limit(instrumented: Sdk) -> None:
    engine = support.engine(cpu_chunks=8)
    stats = engine.scheduler.get_kv_connector_stats()  # the first carries the tier's facts, once
    assert stats is not None
    (info,) = stats.data["info"]  # what becomes vllm:kv_offload_config_info
    stated = info["cpu_num_chunks"] * info["cpu_blocks_per_chunk"] * support.BLOCK_SIZE
    assert instrumented.value("hicache.pool.limit", HOST) == stated == 8 * support.BLOCK_SIZE
    assert sum(instrumented.counters()[MISMATCH].values()) == 0


class MisstatingSpec(support.HostCopySpec):
    """An out-of-tree spec whose manager states one chunk more than it holds."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        stated = vars(self)["cpu_info"]  # vLLM >= 0.33: CPUOffloadingInfo, what its manager will state
        self.cpu_info = dataclasses.replace(stated, cpu_num_chunks=self.num_chunks + 1)


def test_a_stated_capacity_the_manager_does_not_hold_is_a_mismatch_with_one_warning(
    instrumented: Sdk, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="otel_hicache"):
        engine = stepping.stepper(cpu_chunks=8, spec_name="MisstatingSpec", spec_module_path=__name__)
        assert engine.connector.manager._num_chunks == 8
        assert instrumented.value("hicache.pool.limit", HOST) == 9 * support.BLOCK_SIZE  # what vLLM states
        assert instrumented.counters()[MISMATCH] == {("hicache.pool.limit",): 1}
        assert instrumented.counters()[MISMATCH] == {("hicache.pool.limit",): 1}  # counted once
    warnings = [r.getMessage() for r in caplog.records if "disagrees with the engine" in r.getMessage()]
    assert len(warnings) == 1 and "hicache.pool.limit" in warnings[0]
