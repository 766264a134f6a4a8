"""Exporters are chosen the SDK's way: an exporter installed as an ``opentelemetry_traces_exporter`` /
``opentelemetry_metrics_exporter`` entry point is usable by its name in ``OTEL_*_EXPORTER``, with no change here.

The distribution below is real (a ``.dist-info`` with its ``entry_points.txt`` on the path); its exporters append
what they get to a file, which is how the test reads what they exported."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from otel_hicache.config import ConfigError, validate
from tests.core.support import clean_env

EXPORTERS = textwrap.dedent(
    """
    import json, os

    from opentelemetry.sdk.metrics.export import AggregationTemporality, MetricExporter, MetricExportResult
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult


    def _write(line):
        with open(os.environ["OTEL_EXPORTER_JOURNAL_FILE"], "a") as out:
            out.write(json.dumps(line) + "\\n")


    class JournalSpans(SpanExporter):
        def export(self, spans):
            _write({"pid": os.getpid(), "spans": [span.name for span in spans]})
            return SpanExportResult.SUCCESS


    class JournalMetrics(MetricExporter):
        def __init__(self):
            super().__init__(preferred_temporality={})

        def export(self, metrics_data, timeout_millis=10_000, **kwargs):
            names = [m.name for rm in metrics_data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics]
            _write({"pid": os.getpid(), "metrics": names})
            return MetricExportResult.SUCCESS

        def force_flush(self, timeout_millis=10_000):
            return True

        def shutdown(self, timeout_millis=30_000, **kwargs):
            return None
    """
)

HOST = textwrap.dedent(
    """
    import json, os
    from otel_hicache import configure, TransferRecord, TransferOperation
    setup = configure()
    for _ in range(3):
        setup.telemetry.record_transfer(TransferRecord(TransferOperation.BACKUP, {"kv": 8}, 512, 10, 20))
    setup.force_flush()
    print(json.dumps({"mode": setup.mode, "host": os.getpid(), "exporter": setup.telemetry.export_pid}))
    setup.shutdown()
    """
)


@pytest.fixture
def journal_distribution(tmp_path: Path) -> Path:
    """A directory holding an installed distribution ``journal-exporter`` with one trace and one metrics exporter."""
    site = tmp_path / "site"
    info = site / "journal_exporter-1.0.dist-info"
    info.mkdir(parents=True)
    (site / "journal_exporter.py").write_text(EXPORTERS)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: journal-exporter\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(
        "[opentelemetry_traces_exporter]\njournal = journal_exporter:JournalSpans\n\n"
        "[opentelemetry_metrics_exporter]\njournal = journal_exporter:JournalMetrics\n"
    )
    return site


def test_an_installed_exporter_is_chosen_by_its_entry_point_name_and_runs_in_the_export_process(
    journal_distribution: Path, tmp_path: Path
) -> None:
    journal = tmp_path / "journal.jsonl"
    env = clean_env(
        PYTHONPATH=str(journal_distribution),
        OTEL_TRACES_EXPORTER="journal",
        OTEL_METRICS_EXPORTER="journal",
        OTEL_EXPORTER_JOURNAL_FILE=str(journal),
    )
    done = subprocess.run([sys.executable, "-c", HOST], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    host = json.loads(done.stdout)
    lines = [json.loads(line) for line in journal.read_text().splitlines()]
    assert host["mode"] == "otlp" and host["exporter"] not in (None, host["host"])
    assert {line["pid"] for line in lines} == {host["exporter"]}  # exported by the export process, not the host
    assert [name for line in lines for name in line.get("spans", [])] == ["hicache.backup"] * 3
    assert "hicache.transfer.tokens" in {name for line in lines for name in line.get("metrics", [])}


def test_an_exporter_name_no_entry_point_has_is_refused_naming_the_installed_ones() -> None:
    with pytest.raises(ConfigError) as refused:
        validate({"OTEL_TRACES_EXPORTER": "otlp,journal"})
    message = str(refused.value)
    assert message.startswith("OTEL_TRACES_EXPORTER='otlp,journal' is not supported; use one of: none, console, otlp")
    assert "opentelemetry_traces_exporter entry points" in message
