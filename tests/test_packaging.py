"""The distribution says what the code says: one version, the instrumented engines, the licence, the type marker; and
the core installs light: no torch, click, tqdm or numpy, no testing code."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import zipfile
from collections.abc import Iterable
from importlib.metadata import distribution, metadata, requires
from pathlib import Path

import pytest

import otel_hicache
from otel_hicache import package, version
from otel_hicache.testing.otlp_receiver import OtlpReceiver

ROOT = Path(__file__).parents[1]


def test_the_version_is_written_once_and_the_build_reads_it() -> None:
    assert otel_hicache.__version__ == version.__version__ == metadata("otel-hicache")["Version"]


def test_each_engine_extra_lists_what_its_integration_instruments() -> None:
    from packaging.requirements import Requirement

    def parsed(requirements: Iterable[str]) -> set[tuple[str, str]]:
        return {(r.name, str(r.specifier)) for r in map(Requirement, requirements)}

    for name, entry in package.EXTRAS.items():
        extra = [r.split(";")[0] for r in requires("otel-hicache") or () if f'extra == "{name}"' in r]
        assert parsed(extra) == parsed(entry)


def test_opentelemetry_instrument_applies_no_package_wide_requirement_to_our_instrumentors() -> None:
    """It checks a distribution's ``instruments`` / ``instruments-any`` extras against each of its instrumentors:
    an SGLang requirement there would keep the vLLM instrumentor from loading (and the reverse)."""
    from opentelemetry.instrumentation.dependencies import get_dist_dependency_conflicts

    assert get_dist_dependency_conflicts(distribution("otel-hicache")) is None


def test_each_supported_engine_range_has_an_upper_bound() -> None:
    from packaging.requirements import Requirement

    for requirement in (*package._instruments_sglang, *package._instruments_vllm):
        assert any(spec.operator in ("<", "<=", "==", "~=") for spec in Requirement(requirement).specifier)


def test_the_declared_licence_is_the_shipped_licence_text() -> None:
    assert metadata("otel-hicache")["License-Expression"] == "Apache-2.0"
    assert (ROOT / "LICENSE").read_text().split()[:4] == ["Apache", "License", "Version", "2.0,"]


def test_the_package_ships_its_type_marker() -> None:
    assert (Path(otel_hicache.__file__).parent / "py.typed").is_file()


# ---------------------------------------------------------------------- the light install
#: What only the demo needs (the ``demo`` extra): blocked below, as if not installed.
DEMO_ONLY = ("torch", "click", "tqdm", "numpy")


def blocked(tmp_path: Path, *names: str) -> dict[str, str]:
    """An environment in which importing each of ``names`` fails as if it were not installed (a package of that name
    that raises ModuleNotFoundError, first on the path: the export process inherits it too)."""
    for name in names:
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(f"raise ModuleNotFoundError('blocked: {name}', name='{name}')\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    return {**env, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}


LIGHT = textwrap.dedent(
    """
    import json, sys
    import otel_hicache
    from otel_hicache import TransferOperation, TransferRecord, make_timing_event_pair

    modes = {}
    for env in ({}, {"OTEL_EXPORTER_OTLP_ENDPOINT": sys.argv[1], "OTEL_METRIC_EXPORT_INTERVAL": "100"}):
        setup = otel_hicache.configure(env=env)
        setup.telemetry.record_transfer(TransferRecord(TransferOperation.BACKUP, {"kv": 4}, 256, 10, 20))
        modes[setup.mode] = setup.telemetry.snapshot()["hicache.transfer.tokens"][("backup", "kv")]
        setup.force_flush()
        setup.shutdown()
    timing = make_timing_event_pair()[2].value
    print(json.dumps({"modes": modes, "timing": timing, "loaded": sorted(m for m in ("torch", "click", "tqdm",
          "numpy") if m in sys.modules and sys.modules[m] is not None)}))
    """
)


def test_the_core_imports_and_configures_without_torch_click_tqdm_or_numpy(tmp_path: Path) -> None:
    with OtlpReceiver() as rx:
        done = subprocess.run(
            [sys.executable, "-c", LIGHT, rx.grpc_endpoint],
            env=blocked(tmp_path, *DEMO_ONLY),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        assert rx.wait_for(lambda: [s.name for s in rx.spans()] == ["hicache.backup"], 30)  # from the export process
    assert json.loads(done.stdout) == {"modes": {"embedded": 4, "otlp": 4}, "timing": "host_clock", "loaded": []}


def readme_example(title: str) -> str:
    """The Python block of the README section ``title``."""
    text = (ROOT / "README.md").read_text().split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(r"```python\n(.*?)```", text, re.S)
    return str(block)


def test_the_readme_example_on_the_core_install_prints_nothing_on_stderr(tmp_path: Path) -> None:
    """Without torch the host clock is the documented clock: no warning about CUDA timing. torch, click, tqdm and numpy
    are blocked by packages first on the path that raise ModuleNotFoundError on import, as a missing package does
    (the interpreter and its site-packages stay the real ones: a second venv would cost minutes per run)."""
    script = readme_example("The pipeline and your own engine") + "setup.shutdown()\n"
    done = subprocess.run(
        [sys.executable, "-c", script], env=blocked(tmp_path, *DEMO_ONLY), capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""


def test_a_torch_that_cannot_time_says_so_in_one_line(tmp_path: Path) -> None:
    """A torch that is installed but broken (its CUDA library missing, which no CPU machine can cause otherwise): one
    warning, however many pairs are made, and host-clock timing."""
    (tmp_path / "torch").mkdir()
    broken = "raise OSError('libcudart.so.12: cannot open shared object file')\n"
    (tmp_path / "torch" / "__init__.py").write_text(broken)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    script = "from otel_hicache import make_timing_event_pair as m; print(m()[2].value, m()[2].value)"
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["host_clock", "host_clock"]
    assert done.stderr.splitlines() == [
        "otel_hicache: CUDA event timing unavailable (libcudart.so.12: cannot open shared object file); "
        "using the host clock"
    ]


@pytest.mark.parametrize("missing", ["click", "torch"])
def test_the_command_without_the_demo_extra_says_in_one_line_what_to_install(tmp_path: Path, missing: str) -> None:
    command = [sys.executable, "-m", "otel_hicache", "demo", "--requests", "5"]
    done = subprocess.run(command, env=blocked(tmp_path, missing), capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"{'otel-hicache' if missing == 'click' else 'Error'}: the demo needs {missing}, which is not installed "
        "here: pip install 'otel-hicache[demo]'"
    ]


def test_the_wheel_ships_no_testing_code_and_requires_only_the_core(tmp_path: Path) -> None:
    source = tmp_path / "clone"  # what a clone holds (no build/ of an earlier run), as the Dockerfile copies it
    shutil.copytree(ROOT / "src", source / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, source / name)
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), source],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert built.returncode == 0, built.stderr
    (wheel,) = tmp_path.glob("otel_hicache-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        (meta,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        metadata = archive.read(meta).decode()
    assert "otel_hicache/telemetry.py" in names and "otel_hicache/_internal/host/worker.py" in names
    assert not [n for n in names if n.startswith("otel_hicache/testing")]
    requires = [line.split(":", 1)[1].strip() for line in metadata.splitlines() if line.startswith("Requires-Dist:")]
    core = {re.split(r"[ <>=\[;]", r, maxsplit=1)[0] for r in requires if "extra ==" not in r}
    assert core == {
        "opentelemetry-api",
        "opentelemetry-sdk",
        "opentelemetry-exporter-otlp",
        "opentelemetry-instrumentation",
        "opentelemetry-exporter-prometheus",
        "wrapt",
    }
    demo = {r.split(";")[0].strip() for r in requires if 'extra == "demo"' in r}
    assert demo == set(package.DEMO)
