"""A second engine is one small adapter on ``integrations._base``: shown with a toy engine written by the test.

The toy engine is a real module on ``sys.path``, imported only after ``instrument()``: the adapter patches it when it is
imported, reports its offloads through the telemetry, passes through under ``suppress_instrumentation()`` and leaves
nothing behind after ``uninstrument()`` (also when the engine was never imported while instrumented).
"""

from __future__ import annotations

import gc
import importlib
import sys
import weakref
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from opentelemetry.instrumentation.utils import is_instrumentation_enabled, suppress_instrumentation

from otel_hicache import semconv as sc
from otel_hicache.integrations._base import (
    EngineInstrumentor,
    ProcessSink,
    Skips,
    Target,
    Wrapper,
    checks_suppression,
)
from otel_hicache.records import TransferRecord
from otel_hicache.telemetry import HiCacheTelemetry
from otel_hicache.testing.sdk import Sdk
from otel_hicache.timing import now_ns

TOY_ENGINE = '''
class KVStore:
    def offload(self, tokens):
        """Copy ``tokens`` tokens of KV to host memory; returns the bytes moved."""
        return tokens * 128
'''


class ToyInstrumentor(EngineInstrumentor):
    """The whole adapter: supported releases, extra pool names, and one wrapper per engine method."""

    _engine = "toy engine"
    _extra_pools = ("toy_latent",)

    def instrumentation_dependencies(self) -> Collection[str]:
        return ()  # a real adapter returns its entry of otel_hicache.package

    def _patches(self, sink: ProcessSink, options: Mapping[str, Any]) -> Iterable[tuple[Target, Wrapper]]:
        def offload(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            start = now_ns()
            moved = wrapped(*args, **kwargs)
            telemetry = sink.get()  # built at the first event
            assert telemetry is not None
            telemetry.record_transfer(
                TransferRecord(
                    operation=sc.TransferOperation.BACKUP,
                    tokens_by_pool={"kv": args[0], "toy_latent": 1},
                    num_bytes=moved,
                    submit_time_ns=start,
                    complete_time_ns=now_ns(),
                )
            )
            return moved

        return [(Target("toy_engine", "KVStore", "offload", ("tokens",)), offload)]


@pytest.fixture
def toy_engine_path(tmp_path: Path) -> Iterator[Path]:
    """The toy engine as an installed package would be: ``toy_engine/__init__.py`` on ``sys.path``."""
    package = tmp_path / "toy_engine"
    package.mkdir()
    (package / "__init__.py").write_text(TOY_ENGINE)
    sys.path.insert(0, str(tmp_path))
    yield package
    sys.path.remove(str(tmp_path))
    for name in [m for m in sys.modules if m == "toy_engine" or m.startswith("toy_engine.")]:
        del sys.modules[name]


def backed_up(sdk: Sdk) -> dict[tuple[Any, ...], int]:
    return {k: v for k, v in sdk.counters()[sc.METRIC_TRANSFER_TOKENS].items() if k[0] == "backup" and v}


def test_a_toy_engine_is_patched_on_import_reports_and_is_restored(toy_engine_path: Path, sdk: Sdk) -> None:
    instrumentor = ToyInstrumentor()
    instrumentor.instrument(tracer_provider=sdk.tracer_provider, meter_provider=sdk.meter_provider)
    try:
        assert "toy_engine" not in sys.modules  # instrument() imported nothing of the engine
        toy_engine = importlib.import_module("toy_engine")
        original = toy_engine.KVStore.__dict__["offload"].__wrapped__
        store = toy_engine.KVStore()
        assert store.offload(16) == 16 * 128
        with suppress_instrumentation():
            assert store.offload(1000) == 1000 * 128  # passes straight through
        with sdk.tracer_provider.get_tracer("caller").start_as_current_span("caller"):
            assert store.offload(4) == 4 * 128  # a context with other values: reported
        telemetry = instrumentor.telemetry
        assert telemetry is not None
        telemetry.flush()
        counted = {k: v for k, v in telemetry.snapshot()[sc.METRIC_TRANSFER_TOKENS].items() if v}
        assert counted == {("backup", "kv"): 20, ("backup", "toy_latent"): 2}  # the adapter's own pool name is known
        spans = sdk.spans("hicache.backup")
        assert [dict(span.attributes or {}).get(sc.ATTR_BYTES) for span in spans] == [16 * 128, 4 * 128]
    finally:
        instrumentor.uninstrument()
    assert toy_engine.KVStore.__dict__["offload"] is original
    toy_engine.KVStore().offload(8)
    assert telemetry.snapshot()[sc.METRIC_TRANSFER_TOKENS][("backup", "kv")] == 20  # nothing reported any more


def test_uninstrument_disarms_patches_for_modules_not_imported_yet(toy_engine_path: Path, sdk: Sdk) -> None:
    instrumentor = ToyInstrumentor()
    instrumentor.instrument(telemetry=sdk.telemetry)
    instrumentor.uninstrument()
    toy_engine = importlib.import_module("toy_engine")
    assert not hasattr(toy_engine.KVStore.__dict__["offload"], "__wrapped__")
    toy_engine.KVStore().offload(8)
    assert backed_up(sdk) == {}


def test_a_wrapper_marked_checks_suppression_is_installed_unguarded(toy_engine_path: Path, sdk: Sdk) -> None:
    seen: list[bool] = []

    class SelfGuarded(EngineInstrumentor):
        def instrumentation_dependencies(self) -> Collection[str]:
            return ()

        def _patches(self, sink: ProcessSink, options: Mapping[str, Any]) -> Iterable[tuple[Target, Wrapper]]:
            @checks_suppression
            def offload(
                wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
            ) -> Any:
                seen.append(is_instrumentation_enabled())  # it decides for itself what suppression means
                return wrapped(*args, **kwargs)

            return [(Target("toy_engine", "KVStore", "offload"), offload)]

    store = importlib.import_module("toy_engine").KVStore()  # already imported: patched at instrument()
    instrumentor = SelfGuarded()
    instrumentor.instrument(telemetry=sdk.telemetry)
    try:
        store.offload(1)
        with suppress_instrumentation():
            store.offload(2)
    finally:
        instrumentor.uninstrument()
    assert seen == [True, False]


def test_instrument_cycles_before_the_engine_is_imported_keep_no_old_telemetry_alive(toy_engine_path: Path) -> None:
    instrumentor = ToyInstrumentor()
    old: list[weakref.ref[HiCacheTelemetry]] = []
    for _ in range(3):
        telemetry = HiCacheTelemetry()
        instrumentor.instrument(telemetry=telemetry)
        instrumentor.uninstrument()  # toy_engine never imported: wrapt keeps each cycle's post-import hook
        telemetry.shutdown()
        old.append(weakref.ref(telemetry))
    del telemetry
    gc.collect()
    assert [ref() is None for ref in old[:-1]] == [True, True]  # the instrumentor keeps only its last sink


@pytest.fixture
def toy_instrumented(toy_engine_path: Path, sdk: Sdk) -> Iterator[ModuleType]:
    """The toy engine, imported and instrumented to report into ``sdk``; uninstrumented afterwards."""
    toy_engine = importlib.import_module("toy_engine")
    instrumentor = ToyInstrumentor()
    instrumentor.instrument(telemetry=sdk.telemetry)
    yield toy_engine
    instrumentor.uninstrument()


def test_an_object_skips_our_wrapper_while_told_and_never_loses_another_partys_patch_of_it(
    toy_instrumented: ModuleType, sdk: Sdk
) -> None:
    skipping, patched = toy_instrumented.KVStore(), toy_instrumented.KVStore()
    theirs = patched.offload = lambda tokens: tokens  # another party's patch of one object
    skips, untouched = Skips(skipping, ["offload"]), Skips(patched, ["offload"])
    skips.set("offload", True)
    untouched.set("offload", True)
    assert skipping.offload(8) == 8 * 128  # the engine's method, not reported
    assert patched.offload(2) == 2 and patched.offload is theirs
    skips.set("offload", False)
    assert skipping.offload(16) == 16 * 128  # reported again
    skips.set("offload", True)
    skips.end()
    assert "offload" not in vars(skipping) and patched.offload is theirs
    assert backed_up(sdk)[("backup", "kv")] == 16  # the one call made while not skipped


def test_skips_keep_no_engine_object_alive_and_never_skip_a_wrapper_put_over_ours_later(
    toy_instrumented: ModuleType,
) -> None:
    import wrapt

    store = toy_instrumented.KVStore()
    store.again = store.offload  # a bound method of its own in its __dict__, as SGLang's controllers hold
    skips = Skips(store, ["offload"])
    skips.set("offload", True)
    gone = weakref.ref(store)
    del store
    gc.collect()
    assert gone() is None  # the skips still held here keep none of it

    seen: list[int] = []

    def theirs(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        seen.append(args[0])
        return wrapped(*args, **kwargs)

    other = toy_instrumented.KVStore()
    later = Skips(other, ["offload"])
    wrapt.wrap_function_wrapper(toy_instrumented.KVStore, "offload", theirs)  # another party's, over ours
    later.set("offload", True)
    assert other.offload(3) == 3 * 128 and seen == [3]
