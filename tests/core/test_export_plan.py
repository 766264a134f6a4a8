"""The plan a host hands its export process: one typed structure, serialized in one place, readable before the OTel
API is imported."""

from __future__ import annotations

import os
import subprocess
import sys

from otel_hicache._internal.shared.plan import ExportPlan

PLAN = ExportPlan(
    environment={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317", "OTEL_BSP_SCHEDULE_DELAY": "50"},
    resource={"service.name": "svc", "hicache.rank.tp": 1, "sampled": True, "weight": 0.5},
    endpoint="http://127.0.0.1:4317",
    protocol="grpc",
    cardinality_limit=10,
    spans=False,
    token_metrics=False,
    pools=("kv", "other"),
    seed_pools=("kv",),
    capacity=64,
)


def test_a_plan_reads_back_as_it_was_written() -> None:
    assert ExportPlan.from_json(PLAN.to_json()) == PLAN


def test_a_plan_is_read_before_anything_imports_the_otel_api() -> None:
    """The exporter sets its environment from the plan: the OTel API reads OTEL_PYTHON_CONTEXT on import."""
    script = (
        "import sys\n"
        "from otel_hicache._internal.shared.plan import ExportPlan\n"
        "plan = ExportPlan.from_json(sys.stdin.buffer.read())\n"
        "print(plan.capacity, sorted(m for m in sys.modules if m.startswith('opentelemetry')))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], input=PLAN.to_json(), capture_output=True, check=True)
    assert done.stdout.decode().split(maxsplit=1) == ["64", "[]\n"]


def test_a_forked_childs_plan_has_its_own_process_identity_and_the_rest_of_its_parents() -> None:
    child = PLAN.for_child()
    assert child.resource["process.pid"] == os.getpid()
    assert child.resource["service.instance.id"] != PLAN.resource.get("service.instance.id")
    assert {k: v for k, v in child.resource.items() if k not in ("process.pid", "service.instance.id")} == PLAN.resource
    assert (child.environment, child.pools, child.capacity) == (PLAN.environment, PLAN.pools, PLAN.capacity)
