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


def interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's ``${VAR:-default}`` interpolation, as ``docker compose`` applies it with ``env``."""
    return re.sub(r"\$\{(\w+):-([^}]*)\}", lambda m: env.get(m.group(1)) or m.group(2), text)


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
    # the names the rules and the dashboard use, chosen explicitly rather than by a deprecated default
    assert prometheus["translation_strategy"] == "UnderscoreEscapingWithSuffixes"


@pytest.mark.parametrize("name", ["otel-collector.yaml", "fleet/gateway.yaml"])
def test_a_dead_processs_series_leave_the_scrape_within_minutes_but_outlast_a_late_export(name: str) -> None:
    """metric_expiration: above 2x the SDK's default export interval (60 s), well under the pool alert's 15 m."""
    expiration = duration_s(load(COLLECTORS[name])["exporters"]["prometheus"]["metric_expiration"])
    pool_alert = next(
        r
        for g in load(CONFIG / "rules" / "hicache.rules.yml")["groups"]
        for r in g["rules"]
        if r.get("alert") == "HiCacheHostPoolSaturated"
    )
    assert 2 * 60 <= expiration <= 5 * 60 < duration_s(pool_alert["for"])


@pytest.mark.parametrize("name", ["otel-collector.yaml", "fleet/gateway.yaml"])
def test_the_collectors_own_metrics_reader_keeps_the_collectors_default_names(name: str) -> None:
    """A custom reader replaces the default one: its without_* defaults must be restated."""
    (reader,) = load(COLLECTORS[name])["service"]["telemetry"]["metrics"]["readers"]
    prometheus = reader["pull"]["exporter"]["prometheus"]
    assert prometheus["without_units"] is prometheus["without_type_suffix"] is prometheus["without_scope_info"] is True


def test_the_fleet_agent_is_a_daemonset_listening_on_its_pod_ip() -> None:
    agent = load(COLLECTORS["fleet/agent.yaml"])
    text = COLLECTORS["fleet/agent.yaml"].read_text()
    assert "deployed as a DaemonSet" in text and "hostPort" in text
    for protocol in agent["receivers"]["otlp"]["protocols"].values():
        # reachable through the node's hostPort from other pods; not every interface, not loopback
        assert host_of(protocol["endpoint"]) == "${env:MY_POD_IP}"
    assert host_of(agent["extensions"]["health_check"]["endpoint"]) == "${env:MY_POD_IP}"


def test_the_fleet_agent_routes_each_processs_metrics_to_one_gateway_and_traces_round_robin() -> None:
    agent, gateway = load(COLLECTORS["fleet/agent.yaml"]), load(COLLECTORS["fleet/gateway.yaml"])
    gateway_port = port_of(gateway["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"])
    pipelines = agent["service"]["pipelines"]

    (metrics_exporter,) = pipelines["metrics"]["exporters"]
    assert metrics_exporter.split("/")[0] == "loadbalancing"
    balancer = agent["exporters"][metrics_exporter]
    # the whole Resource (service.instance.id, host, pid, ranks) is the key: one process, one replica
    assert balancer["routing_key"] == "resource"
    dns = balancer["resolver"]["dns"]
    assert "gateway" in dns["hostname"] and int(dns["port"]) == gateway_port
    assert "endpoint" not in balancer["protocol"]["otlp"]  # the resolver supplies it

    (traces_exporter,) = pipelines["traces"]["exporters"]
    traces = agent["exporters"][traces_exporter]
    assert traces_exporter.startswith("otlp_grpc/") and traces["balancer_name"] == "round_robin"
    assert host_of(traces["endpoint"]) == dns["hostname"]  # the same headless Service: every replica
    assert port_of(traces["endpoint"]) == gateway_port


def test_the_fleet_agent_keeps_the_sdks_host_name() -> None:
    (processor,) = [
        p for n, p in load(COLLECTORS["fleet/agent.yaml"])["processors"].items() if n == "resourcedetection"
    ]
    assert processor["override"] is False


def test_the_gateway_recycles_connections_and_labels_its_replica() -> None:
    gateway = load(COLLECTORS["fleet/gateway.yaml"])
    keepalive = gateway["receivers"]["otlp"]["protocols"]["grpc"]["keepalive"]["server_parameters"]
    assert duration_s(keepalive["max_connection_age"]) <= 300
    assert gateway["exporters"]["prometheus"]["const_labels"] == {"otel_gateway": "${env:POD_NAME}"}


def duration_s(text: str) -> float:
    """A Go / Prometheus duration such as 90s, 3m or 1h30m in seconds."""
    parts = re.fullmatch(r"(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?", text)
    assert parts and text, text
    hours, minutes, seconds = (int(p or 0) for p in parts.groups())
    return hours * 3600 + minutes * 60 + seconds


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
    # 127.0.0.1, not localhost (which may resolve to ::1 where Jaeger does not listen)
    assert host_of(jaeger["endpoint"]) == "0.0.0.0"
    assert f"http://127.0.0.1:{port_of(jaeger['endpoint'])}{jaeger['status']['path']}" in probes["jaeger"]
    assert "http://127.0.0.1:9090/-/ready" in probes["prometheus"]
    assert "http://127.0.0.1:3000/api/health" in probes["grafana"]
    assert services["grafana"]["depends_on"]["prometheus"]["condition"] == "service_healthy"
    assert services["otel-collector"]["depends_on"]["jaeger"]["condition"] == "service_healthy"


def test_published_ports_bind_127_0_0_1_unless_the_user_says_otherwise() -> None:
    for name, service in compose()["services"].items():
        for port in service.get("ports", []):
            host, published_port, container_port = interpolate(str(port), {}).split(":")
            assert host == "127.0.0.1", f"{name}: {port} is published on every interface by default"
            assert published_port == container_port
            assert interpolate(str(port), {"HICACHE_PUBLISH_ADDRESS": "0.0.0.0"}).startswith("0.0.0.0:"), port


def test_grafana_takes_its_admin_password_from_the_environment_and_has_no_anonymous_access_by_default() -> None:
    environment = compose()["services"]["grafana"]["environment"]
    # ${VAR:?message}: compose refuses to start without it, naming the variable
    assert re.fullmatch(r"\$\{GRAFANA_ADMIN_PASSWORD:\?[^}]+\}", environment["GF_SECURITY_ADMIN_PASSWORD"])
    assert interpolate(environment["GF_AUTH_ANONYMOUS_ENABLED"], {}) == "false"
    assert interpolate(environment["GF_AUTH_ANONYMOUS_ENABLED"], {"GRAFANA_ANONYMOUS": "true"}) == "true"


def test_the_readme_names_the_dashboard_by_its_title() -> None:
    title = json.loads(DASHBOARD.read_text())["title"]
    assert f'dashboard "{title}"' in (ROOT / "README.md").read_text()


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
    assert {
        4317,
        4318,
        port_of(collector["exporters"]["prometheus"]["endpoint"]),
        port_of(collector["extensions"]["health_check"]["endpoint"]),
    } <= published("otel-collector")
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
    rows = [p for p in panels if p["type"] == "row"]
    assert all(not row.get("panels") and not row.get("targets") for row in rows)  # layout only, never collapsed
    panels = [p for p in panels if p["type"] != "row"]
    for panel in panels:
        assert panel["datasource"]["uid"] in uids, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] in uids and target["expr"].strip(), panel["title"]
    assert any(t.get("exemplar") for p in panels for t in p["targets"]), "the duration panel should show exemplars"
