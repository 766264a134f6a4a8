"""Engines change under the adapters: what ``integrations._base`` does when a release no longer fits.

Each test writes a toy engine package the way a later release might look (a method gone, turned into a property,
given other parameters, a module removed), instruments it with a small adapter, and checks the rule: what does not fit
is left unpatched with one warning naming it, the rest is instrumented, and nothing of ours raises into the engine or
changes what the engine raises. Warnings come once per process family: real sibling processes are started to show it.
"""

from __future__ import annotations

import importlib
import logging
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from otel_hicache.integrations._base import EngineInstrumentor, ProcessSink, Target, Wrapper
from otel_hicache.testing.sdk import Sdk

RELEASE = """
class KVStore:
    def offload(self, tokens, pool="kv"):
        return tokens * 128

    def evict(self, tokens):
        if tokens < 0:
            raise ValueError("the engine's own error")
        return tokens
"""

Seen = list[tuple[str, tuple[Any, ...]]]


def adapter(targets: Iterable[Target], seen: Seen, fail: str = "") -> EngineInstrumentor:
    """An adapter whose wrapper notes each call it sees; ``fail``: raise in our code ``before`` / ``after`` the call."""

    class Adapter(EngineInstrumentor):
        _engine = "toy engine"

        def instrumentation_dependencies(self) -> Collection[str]:
            return ()

        def _patches(self, sink: ProcessSink, options: Mapping[str, Any]) -> Iterable[tuple[Target, Wrapper]]:
            return [(target, noting(target.attribute)) for target in targets]

    def noting(name: str) -> Wrapper:
        def wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            if fail == "before":
                raise RuntimeError("our bug, before the engine's call")
            try:
                return wrapped(*args, **kwargs)
            finally:
                seen.append((name, args))
                if fail == "after":
                    raise RuntimeError("our bug, after the engine's call")

        return wrapper

    return Adapter()


@pytest.fixture
def release(tmp_path: Path) -> Iterator[Callable[[str], Any]]:
    """Install a toy engine release: ``release(source)`` writes ``toy_release/store.py`` and imports it."""
    package = tmp_path / "toy_release"
    package.mkdir()
    (package / "__init__.py").write_text("")
    sys.path.insert(0, str(tmp_path))

    def install(source: str) -> Any:
        (package / "store.py").write_text(textwrap.dedent(source))
        return importlib.import_module("toy_release.store")

    yield install
    sys.path.remove(str(tmp_path))
    for name in [m for m in sys.modules if m.split(".")[0] == "toy_release"]:
        del sys.modules[name]


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and "otel_hicache" in r.getMessage()]


@pytest.mark.parametrize(
    ("drifted", "problem"),
    [
        ("class KVStore:\n    pass\n", "KVStore.offload (missing)"),
        ("class KVStore:\n    offload = property(lambda self: 0)\n", "KVStore.offload (a property, not a function)"),
        ("class KVStore:\n    offload = staticmethod(lambda tokens: 0)\n", "not a function"),
        ("class KVStore:\n    def offload(self, pool, tokens):\n        return 0\n", "KVStore.offload (parameters"),
        ("KVStore = object()\n", "KVStore is not a class"),
    ],
)
def test_a_target_of_another_shape_is_left_unpatched_with_one_warning_naming_it(
    release: Callable[[str], Any], sdk: Sdk, caplog: pytest.LogCaptureFixture, drifted: str, problem: str
) -> None:
    store = release(drifted + "\ndef ready():\n    return True\n")
    before = dict(vars(store.KVStore)) if isinstance(store.KVStore, type) else None
    seen: Seen = []
    targets = [Target("toy_release.store", "KVStore", "offload", ("tokens",)), Target("toy_release.store", "", "ready")]
    instrumentor = adapter(targets, seen)
    with caplog.at_level(logging.WARNING):
        instrumentor.instrument(telemetry=sdk.telemetry)
        instrumentor.uninstrument()
        instrumentor.instrument(telemetry=sdk.telemetry)
    try:
        if before is not None:
            assert dict(vars(store.KVStore)) == before  # left exactly as the engine made it
        assert store.ready() is True and seen == [("ready", ())]  # the rest is instrumented
    finally:
        instrumentor.uninstrument()
    (warning,) = warnings_of(caplog)
    assert problem in warning and "toy_release.store" in warning and "left unpatched" in warning


def test_a_classmethod_target_is_wrapped_by_its_parameters_after_cls_and_put_back_as_it_was(
    release: Callable[[str], Any], sdk: Sdk, caplog: pytest.LogCaptureFixture
) -> None:
    store = release(
        "class Stats:\n"
        "    @classmethod\n"
        "    def from_store(cls, store, running=()):\n"
        "        return (cls.__name__, store)\n"
        "class Later(Stats):\n"
        "    pass\n"
    )
    original = vars(store.Stats)["from_store"]
    seen: Seen = []
    instrumentor = adapter([Target("toy_release.store", "Stats", "from_store", ("store",))], seen)
    with caplog.at_level(logging.WARNING):
        instrumentor.instrument(telemetry=sdk.telemetry)
    try:
        # still bound to the class it is called on, a subclass included; the wrapper sees the arguments after cls
        assert store.Stats.from_store(7) == ("Stats", 7) and store.Later.from_store(8) == ("Later", 8)
        assert seen == [("from_store", (7,)), ("from_store", (8,))]
    finally:
        instrumentor.uninstrument()
    assert vars(store.Stats)["from_store"] is original and store.Later.from_store(9) == ("Later", 9)
    assert warnings_of(caplog) == []


def test_a_target_module_this_release_lacks_is_warned_about_when_instrumenting(
    release: Callable[[str], Any], sdk: Sdk, caplog: pytest.LogCaptureFixture
) -> None:
    release(RELEASE)
    targets = [Target("toy_release.store", "KVStore", "offload"), Target("toy_release.renamed", "KVStore", "evict")]
    instrumentor = adapter(targets, [])
    with caplog.at_level(logging.WARNING):
        instrumentor.instrument(telemetry=sdk.telemetry)
    instrumentor.uninstrument()
    (warning,) = warnings_of(caplog)
    assert "no module toy_release.renamed" in warning and "KVStore.evict are not reported" in warning
    assert "toy_release.renamed" not in sys.modules  # looked for on disk, not imported


def test_a_module_not_imported_yet_is_not_mistaken_for_a_missing_one(
    release: Callable[[str], Any], sdk: Sdk, caplog: pytest.LogCaptureFixture
) -> None:
    release(RELEASE)
    del sys.modules["toy_release.store"], sys.modules["toy_release"]
    seen: Seen = []
    instrumentor = adapter([Target("toy_release.store", "KVStore", "offload", ("tokens", "pool"))], seen)
    with caplog.at_level(logging.WARNING):
        instrumentor.instrument(telemetry=sdk.telemetry)
    try:
        assert "toy_release.store" not in sys.modules
        assert importlib.import_module("toy_release.store").KVStore().offload(2) == 256
    finally:
        instrumentor.uninstrument()
    assert seen == [("offload", (2,))] and warnings_of(caplog) == []


@pytest.mark.parametrize("fail", ["before", "after"])
def test_our_failing_code_never_reaches_the_engine_which_runs_once_with_its_own_result_or_exception(
    release: Callable[[str], Any], sdk: Sdk, caplog: pytest.LogCaptureFixture, fail: str
) -> None:
    store = release(RELEASE)
    seen: Seen = []
    instrumentor = adapter([Target("toy_release.store", "KVStore", "evict", ("tokens",))], seen, fail=fail)
    calls: list[int] = []
    original = store.KVStore.evict

    def counted(self: Any, tokens: int) -> int:
        calls.append(tokens)
        return original(self, tokens)

    store.KVStore.evict = counted
    instrumentor.instrument(telemetry=sdk.telemetry)
    try:
        with caplog.at_level(logging.WARNING):
            assert store.KVStore().evict(5) == 5
            with pytest.raises(ValueError, match="the engine's own error") as raised:
                store.KVStore().evict(-1)
            assert store.KVStore().evict(7) == 7
    finally:
        instrumentor.uninstrument()
    assert calls == [5, -1, 7]  # each call ran the engine's method exactly once
    assert type(raised.value) is ValueError and raised.value.__cause__ is None
    (warning,) = warnings_of(caplog)  # one line for every failure of this hook
    assert "KVStore.evict failed" in warning and "toy engine runs unchanged" in warning


MEMBER = """
import logging, sys
from pathlib import Path
from otel_hicache.integrations import _base
logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
_base.ONCE.directory = Path(sys.argv[1])
_base.warn_once("unsupported release", "otel_hicache: the toy engine is not instrumented")
"""
#: An engine's launcher: its own process group (a new session), starting one process per rank as engines do.
LAUNCHER = """
import subprocess, sys
for rank in range(3):
    run = subprocess.run([sys.executable, "-c", sys.argv[1], sys.argv[2]], capture_output=True, text=True)
    print(run.returncode, run.stderr.count("WARNING"))
"""


def test_a_problem_is_warned_about_once_per_process_family(fresh_warnings: Path) -> None:
    """The rank processes of one launcher (one process group) warn once between them; another launcher's warn
    again. A family that is gone leaves no marker behind."""

    def family() -> list[str]:
        run = subprocess.run(
            [sys.executable, "-c", LAUNCHER, MEMBER, str(fresh_warnings)],
            capture_output=True,
            text=True,
            timeout=240,
            start_new_session=True,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        )
        assert run.returncode == 0, run.stderr
        return run.stdout.splitlines()

    assert family() == ["0 1", "0 0", "0 0"]  # rank 0 warned; ranks 1 and 2 saw its marker
    assert family() == ["0 1", "0 0", "0 0"]  # another engine start: a family of its own
    assert len(list(fresh_warnings.iterdir())) == 1  # the marker of the first, gone, family was removed
