"""The shipped Collector, Jaeger, Prometheus, Grafana and docker-compose configs hang together.

No Collector, Jaeger, Grafana or Docker engine runs here, so these are structural checks: every file parses, every
component a pipeline names is defined (and every defined one is used), referenced files exist, and the ports and
host names agree across services.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest
import yaml

from tests.pipeline.support import CONFIG, DASHBOARD, ROOT

COMPOSE = ROOT / "docker-compose.yml"
COLLECTORS = {
    "otel-collector.yaml": CONFIG / "otel-collector.yaml",
    "jaeger.yaml": CONFIG / "jaeger.yaml",
    "fleet/agent.yaml": CONFIG / "fleet" / "agent.yaml",
    "fleet/gateway.yaml": CONFIG / "fleet" / "gateway.yaml",
}
#: Component types these configs may use (otelcol-contrib 0.147 and Jaeger 2.x names); catches typos.
KNOWN_TYPES = {
    "receivers": {"otlp"},
    "processors": {"memory_limiter", "batch", "resourcedetection"},
    "exporters": {"otlp_grpc", "otlp_http", "prometheus", "loadbalancing", "jaeger_storage_exporter"},
    "extensions": {"health_check", "healthcheckv2", "jaeger_storage", "jaeger_query"},
}


def load(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def compose() -> dict[str, Any]:
    return load(COMPOSE)


def port_of(endpoint: str) -> int:
    """The port of ``host:port``, ``0.0.0.0:port``, ``http://host:port/path`` or ``dns:///host:port``."""
    return int(re.search(r":(\d+)(?:/|$)", endpoint).group(1))  # type: ignore[union-attr]


def host_of(endpoint: str) -> str:
    if "//" in endpoint:
        return urlparse(endpoint.replace("dns:///", "dns://")).hostname or ""
    return endpoint.rsplit(":", 1)[0]


def published(service: str) -> set[int]:
    return {int(str(p).split(":")[-1]) for p in compose()["services"][service].get("ports", [])}


def mounts(service: str) -> dict[str, Path]:
    """Container path -> host path of a service's bind mounts."""
    out = {}
    for volume in compose()["services"][service].get("volumes", []):
        host, container = volume.split(":")[:2]
        out[container] = (ROOT / host).resolve()
    return out


# --------------------------------------------------------------------------- collector configs
@pytest.mark.parametrize("name", sorted(COLLECTORS))
def test_every_component_a_pipeline_names_is_defined_and_every_defined_one_is_used(name: str) -> None:
    config = load(COLLECTORS[name])
    service = config["service"]
    used: dict[str, set[str]] = {kind: set() for kind in ("receivers", "processors", "exporters")}
    used["extensions"] = set(service.get("extensions", []))
    assert service["pipelines"], name
    for pipeline, spec in service["pipelines"].items():
        assert spec.get("receivers") and spec.get("exporters"), f"{name}: pipeline {pipeline} is incomplete"
        for kind in ("receivers", "processors", "exporters"):
            used[kind] |= set(spec.get(kind, []))
    for kind, names in used.items():
        defined = set(config.get(kind) or {})
        assert names <= defined, f"{name}: {kind} used but not defined: {sorted(names - defined)}"
        assert defined <= names, f"{name}: {kind} defined but unused: {sorted(defined - names)}"
        for component in names:
            assert component.split("/")[0] in KNOWN_TYPES[kind], f"{name}: unknown {kind} type {component}"


@pytest.mark.parametrize("name", ["otel-collector.yaml", "fleet/agent.yaml", "fleet/gateway.yaml"])
def test_otel_hicache_collectors_take_otlp_both_ways_limit_memory_first_and_batch(name: str) -> None:
    config = load(COLLECTORS[name])
    protocols = config["receivers"]["otlp"]["protocols"]
    assert port_of(protocols["grpc"]["endpoint"]) == 4317 and port_of(protocols["http"]["endpoint"]) == 4318
    pipelines = config["service"]["pipelines"]
    assert set(pipelines) == {"traces", "metrics"}
    for pipeline, spec in pipelines.items():
        assert spec["processors"][0] == "memory_limiter", f"{name}/{pipeline}: memory_limiter must come first"
        assert "batch" in spec["processors"], f"{name}/{pipeline}"
    assert "health_check" in config["service"]["extensions"]


@pytest.mark.parametrize("name", ["otel-collector.yaml", "fleet/gateway.yaml"])
def test_exporting_collectors_send_traces_to_jaeger_over_otlp_and_serve_open_metrics_with_exemplars(name: str) -> None:
    config = load(COLLECTORS[name])
    pipelines = config["service"]["pipelines"]
    (trace_exporter,) = pipelines["traces"]["exporters"]
    assert trace_exporter.startswith("otlp_grpc/")
    assert port_of(config["exporters"][trace_exporter]["endpoint"]) == 4317
    assert pipelines["metrics"]["exporters"] == ["prometheus"]
    prometheus = config["exporters"]["prometheus"]
    assert prometheus["enable_open_metrics"] is True  # exemplars need OpenMetrics
    assert prometheus["resource_to_telemetry_conversion"]["enabled"] is False
    assert port_of(prometheus["endpoint"]) == 8889


def test_fleet_agents_forward_to_the_gateways_otlp_port_and_listen_only_locally() -> None:
    agent, gateway = load(COLLECTORS["fleet/agent.yaml"]), load(COLLECTORS["fleet/gateway.yaml"])
    exporters = {e for p in agent["service"]["pipelines"].values() for e in p["exporters"]}
    assert exporters == {"otlp_grpc/gateway"}
    endpoint = agent["exporters"]["otlp_grpc/gateway"]["endpoint"]
    assert port_of(endpoint) == port_of(gateway["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"])
    assert "gateway" in host_of(endpoint)
    for protocol in agent["receivers"]["otlp"]["protocols"].values():
        assert host_of(protocol["endpoint"]) == "127.0.0.1"  # node-local: only this node's processes send to it


# --------------------------------------------------------------------------- docker-compose
def test_compose_runs_the_pinned_stack_and_the_demo_built_from_the_repo() -> None:
    services = compose()["services"]
    assert set(services) == {"otel-collector", "jaeger", "prometheus", "grafana", "demo"}
    images = {name: s.get("image", "") for name, s in services.items()}
    assert images["otel-collector"].startswith("otel/opentelemetry-collector-contrib:")
    assert images["jaeger"].startswith("jaegertracing/jaeger:2.")
    assert images["prometheus"].startswith("prom/prometheus:v")
    assert images["grafana"].startswith("grafana/grafana:")
    for name, image in images.items():
        if name != "demo":
            tag = image.rsplit(":", 1)[1]
            assert re.fullmatch(r"v?\d+\.\d+\.\d+", tag), f"{name}: pin an exact version, not {tag!r}"
    build = services["demo"]["build"]
    dockerfile = (ROOT / build["context"] / build["dockerfile"]).read_text()
    assert "torch==2.13.0" in dockerfile and "download.pytorch.org/whl/cpu" in dockerfile
    assert services["demo"]["command"][:2] == ["demo", "--seconds"]
    assert "otel-hicache" in dockerfile  # the console script is the entry point


def test_compose_health_checks_probe_the_ports_the_services_listen_on() -> None:
    services = compose()["services"]
    jaeger = load(CONFIG / "jaeger.yaml")["extensions"]["healthcheckv2"]["http"]
    probes = {name: " ".join(s["healthcheck"]["test"]) for name, s in services.items() if "healthcheck" in s}
    assert set(probes) == {"jaeger", "prometheus", "grafana"}  # the collector image has no shell or wget
    assert f"localhost:{port_of(jaeger['endpoint'])}{jaeger['status']['path']}" in probes["jaeger"]
    assert "localhost:9090/-/ready" in probes["prometheus"]
    assert "localhost:3000/api/health" in probes["grafana"]
    assert services["grafana"]["depends_on"]["prometheus"]["condition"] == "service_healthy"
    assert services["otel-collector"]["depends_on"]["jaeger"]["condition"] == "service_healthy"


def test_every_bind_mounted_file_exists_and_the_containers_read_the_mounted_configs() -> None:
    services = compose()["services"]
    for name in services:
        for container, host in mounts(name).items():
            assert host.exists(), f"{name}: {host} (mounted at {container}) does not exist"
    collector_config = next(a for a in services["otel-collector"]["command"] if a.startswith("--config="))
    assert mounts("otel-collector")[collector_config.split("=", 1)[1]] == (CONFIG / "otel-collector.yaml").resolve()
    jaeger_config = next(a for a in services["jaeger"]["command"] if a.startswith("--config="))
    assert mounts("jaeger")[jaeger_config.split("=", 1)[1]] == (CONFIG / "jaeger.yaml").resolve()
    prometheus_config = next(a for a in services["prometheus"]["command"] if a.startswith("--config.file="))
    assert mounts("prometheus")[prometheus_config.split("=", 1)[1]] == (CONFIG / "prometheus.yml").resolve()
    assert "--enable-feature=exemplar-storage" in services["prometheus"]["command"]


def test_rule_files_exist_beside_the_prometheus_config_and_are_mounted_at_the_same_relative_path() -> None:
    config = load(CONFIG / "prometheus.yml")
    container_dir = Path("/etc/prometheus")
    prometheus_mounts = mounts("prometheus")
    for rule_file in config["rule_files"]:
        assert (CONFIG / rule_file).exists(), rule_file
        container_path = container_dir / rule_file
        mounted = [c for c in prometheus_mounts if container_path.is_relative_to(c)]
        assert mounted, f"{rule_file} is not mounted under {container_dir}"
        assert (prometheus_mounts[mounted[0]] / container_path.relative_to(mounted[0])).exists()


def test_ports_agree_demo_to_collector_to_jaeger_and_prometheus() -> None:
    services = compose()["services"]
    collector = load(CONFIG / "otel-collector.yaml")
    jaeger = load(CONFIG / "jaeger.yaml")

    # demo -> collector OTLP gRPC receiver
    demo_endpoint = services["demo"]["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"]
    assert services["demo"]["environment"]["OTEL_EXPORTER_OTLP_PROTOCOL"] == "grpc"
    assert host_of(demo_endpoint) == "otel-collector"
    assert port_of(demo_endpoint) == port_of(collector["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"])

    # collector -> jaeger OTLP gRPC receiver
    jaeger_endpoint = collector["exporters"]["otlp_grpc/jaeger"]["endpoint"]
    assert host_of(jaeger_endpoint) == "jaeger" and "jaeger" in services
    assert port_of(jaeger_endpoint) == port_of(jaeger["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"])

    # prometheus scrapes the collector's prometheus exporter and its own telemetry
    scrape = {j["job_name"]: j for j in load(CONFIG / "prometheus.yml")["scrape_configs"]}
    (target,) = scrape["otel-collector"]["static_configs"][0]["targets"]
    assert host_of(target) == "otel-collector"
    assert port_of(target) == port_of(collector["exporters"]["prometheus"]["endpoint"])
    assert scrape["otel-collector"]["honor_labels"] is True
    (self_target,) = scrape["otel-collector-self"]["static_configs"][0]["targets"]
    reader = collector["service"]["telemetry"]["metrics"]["readers"][0]["pull"]["exporter"]["prometheus"]
    assert port_of(self_target) == reader["port"]

    # what the collector listens on is published
    assert {4317, 4318, port_of(collector["exporters"]["prometheus"]["endpoint"]),
            port_of(collector["extensions"]["health_check"]["endpoint"])} <= published("otel-collector")  # fmt: skip
    assert port_of(jaeger["extensions"]["jaeger_query"]["http"]["endpoint"]) in published("jaeger")


def test_grafana_datasources_point_at_the_services_and_exemplars_link_to_jaeger() -> None:
    jaeger = load(CONFIG / "jaeger.yaml")
    sources = {d["type"]: d for d in load(CONFIG / "grafana/provisioning/datasources/datasources.yaml")["datasources"]}
    assert set(sources) == {"prometheus", "jaeger"}
    prometheus_url = urlparse(sources["prometheus"]["url"])
    assert (prometheus_url.hostname, prometheus_url.port) == ("prometheus", 9090)
    assert 9090 in published("prometheus")
    jaeger_url = urlparse(sources["jaeger"]["url"])
    assert jaeger_url.hostname == "jaeger"
    assert jaeger_url.port == port_of(jaeger["extensions"]["jaeger_query"]["http"]["endpoint"])
    (destination,) = sources["prometheus"]["jsonData"]["exemplarTraceIdDestinations"]
    assert destination["datasourceUid"] == sources["jaeger"]["uid"]
    assert destination["name"] == "trace_id"  # the label the Collector's OpenMetrics exemplars carry


def test_grafana_loads_the_dashboard_from_the_mounted_folder_and_its_panels_use_provisioned_datasources() -> None:
    provider = load(CONFIG / "grafana/provisioning/dashboards/dashboards.yaml")["providers"][0]
    grafana_mounts = mounts("grafana")
    folder = grafana_mounts[provider["options"]["path"]]
    assert DASHBOARD.resolve() in {p.resolve() for p in folder.glob("*.json")}
    assert grafana_mounts["/etc/grafana/provisioning"] == (CONFIG / "grafana/provisioning").resolve()

    uids = {d["uid"] for d in load(CONFIG / "grafana/provisioning/datasources/datasources.yaml")["datasources"]}
    dashboard = json.loads(DASHBOARD.read_text())
    panels = dashboard["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    for panel in panels:
        assert panel["datasource"]["uid"] in uids, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] in uids and target["expr"].strip(), panel["title"]
    assert any(t.get("exemplar") for p in panels for t in p["targets"]), "the duration panel should show exemplars"
