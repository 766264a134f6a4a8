"""registry/ is the otel_hicache vocabulary as an OpenTelemetry semantic-convention registry, equal to semconv.py.

No `weaver` binary can be had here (it ships from GitHub releases and crates that this machine cannot reach), so the
files are checked against the rules of Weaver's own schemas, as read from open-telemetry/weaver:
``schemas/semconv.schema.json`` and ``schemas/semconv-syntax.md`` (the group files, the form semantic-conventions'
``model/*/*.yaml`` use) and ``schemas/definition-manifest.v2.json`` with ``crates/weaver_semconv/src/schema_url.rs``
(``manifest.yaml``, the form of semantic-conventions' ``model/manifest.yaml``).
"""

from __future__ import annotations

import copy
import enum
import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest
import yaml

from otel_hicache import semconv as sc
from otel_hicache._internal.emit.emitter import transfer_span_attributes
from otel_hicache.records import TransferRecord
from otel_hicache.version import __version__

REGISTRY = Path(__file__).parents[1] / "registry"

# --------------------------------------------------------------------------- Weaver's rules (semconv.schema.json)
GROUP_TYPES = {"span", "entity", "metric", "event", "attribute_group"}
STABILITY = {"stable", "development", "alpha", "beta", "release_candidate"}
INSTRUMENTS = {"counter", "gauge", "histogram", "updowncounter"}
SPAN_KINDS = {"client", "server", "producer", "consumer", "internal"}
SIMPLE_TYPES = {"string", "int", "double", "boolean", "any", "string[]", "int[]", "double[]", "boolean[]"}
ATTRIBUTE_TYPES = SIMPLE_TYPES | {f"template[{t}]" for t in SIMPLE_TYPES}
BASE_KEYS = {
    "id",
    "type",
    "brief",
    "note",
    "extends",
    "attributes",
    "display_name",
    "deprecated",
    "stability",
    "annotations",
    "entity_associations",
}
GROUP_KEYS = {
    "attribute_group": BASE_KEYS,
    "span": BASE_KEYS | {"span_kind", "events"},
    "metric": BASE_KEYS | {"metric_name", "instrument", "unit"},
    "event": BASE_KEYS | {"name", "body"},
    "entity": BASE_KEYS | {"name"},
}
ATTRIBUTE_KEYS = {"requirement_level", "sampling_relevant", "brief", "note", "examples", "annotations", "role", "tag"}
MEMBER_KEYS = {"id", "value", "brief", "note", "deprecated", "stability", "annotations"}
MANIFEST_KEYS = {"schema_url", "description", "stability", "dependencies"}

#: Attributes the registry references from its dependency (the GenAI registry, which depends on the core one).
EXTERNAL = {
    "error.type": "semantic-conventions model/error/registry.yaml",
    "gen_ai.request.model": "semantic-conventions-genai model/gen-ai/registry.yaml",
    "gen_ai.usage.input_tokens": "semantic-conventions-genai model/gen-ai/registry.yaml",
    "gen_ai.usage.cache_read.input_tokens": "semantic-conventions-genai model/gen-ai/registry.yaml",
}


def attribute_problems(attribute: Any, where: str) -> Iterator[str]:
    if not isinstance(attribute, dict):
        yield f"{where}: an attribute must be a mapping"
        return
    if "ref" in attribute:  # AttributeReference: id, type, stability and deprecation come from the definition
        extra = set(attribute) - ATTRIBUTE_KEYS - {"ref"}
        if extra:
            yield f"{where}: a ref cannot set {sorted(extra)}"
        if not isinstance(attribute["ref"], str):
            yield f"{where}: ref must be a string"
    else:  # AttributeFullSpec
        for key in ("id", "type", "stability"):
            if key not in attribute:
                yield f"{where}: {attribute.get('id', '?')} lacks {key}"
        extra = set(attribute) - ATTRIBUTE_KEYS - {"id", "type", "stability", "deprecated"}
        if extra:
            yield f"{where}: unknown keys {sorted(extra)}"
        if attribute.get("stability") not in STABILITY:
            yield f"{where}: {attribute.get('id')}: stability {attribute.get('stability')!r}"
        kind = attribute.get("type")
        if isinstance(kind, dict):
            yield from enum_problems(kind, f"{where}: {attribute.get('id')}")
        elif kind not in ATTRIBUTE_TYPES:
            yield f"{where}: {attribute.get('id')}: type {kind!r}"
        if kind in ("string", "string[]") and "examples" not in attribute:
            yield f"{where}: {attribute.get('id')}: string attributes need examples"
    level = attribute.get("requirement_level", "recommended")
    if not requirement_level_ok(level):
        yield f"{where}: requirement_level {level!r}"


def requirement_level_ok(level: Any) -> bool:
    """``required``, ``recommended``, ``opt_in``, or ``{conditionally_required | recommended: <condition>}``."""
    if level in ("required", "recommended", "opt_in"):
        return True
    if not isinstance(level, dict) or len(level) != 1:
        return False
    ((key, condition),) = level.items()
    return key in ("conditionally_required", "recommended") and isinstance(condition, str)


def enum_problems(kind: dict[str, Any], where: str) -> Iterator[str]:
    if set(kind) != {"members"} or not isinstance(kind["members"], list) or not kind["members"]:
        yield f"{where}: an enum type is exactly a non-empty members list"
        return
    for member in kind["members"]:
        if not isinstance(member, dict) or not {"id", "value", "stability"} <= set(member):
            yield f"{where}: member {member!r} needs id, value and stability"
        elif set(member) - MEMBER_KEYS or member["stability"] not in STABILITY:
            yield f"{where}: member {member['id']}: unknown keys or stability"
        elif not isinstance(member["value"], (str, int, float)) or isinstance(member["value"], bool):
            yield f"{where}: member {member['id']}: value must be a string or a number"


def group_problems(group: Any) -> Iterator[str]:
    if not isinstance(group, dict):
        yield "a group must be a mapping"
        return
    where = str(group.get("id", "?"))
    kind = group.get("type")
    if kind not in GROUP_TYPES:
        yield f"{where}: type {kind!r}"
        return
    for key in ("id", "brief"):
        if not isinstance(group.get(key), str):
            yield f"{where}: {key} must be a string"
    if kind != "attribute_group" and group.get("stability") not in STABILITY:
        yield f"{where}: stability {group.get('stability')!r}"
    if kind not in ("metric", "event") and "attributes" not in group and "extends" not in group:
        yield f"{where}: needs attributes or extends"
    extra = set(group) - GROUP_KEYS[kind]
    if extra:
        yield f"{where}: unknown keys {sorted(extra)}"
    if kind == "span" and group.get("span_kind") not in SPAN_KINDS:
        yield f"{where}: span_kind {group.get('span_kind')!r}"
    if kind == "metric":
        if group.get("instrument") not in INSTRUMENTS:
            yield f"{where}: instrument {group.get('instrument')!r}"
        for key in ("metric_name", "unit"):
            if not isinstance(group.get(key), str):
                yield f"{where}: {key} must be a string"
    if kind == "entity" and not isinstance(group.get("name"), str):
        yield f"{where}: an entity needs a name"
    for attribute in group.get("attributes", []):
        yield from attribute_problems(attribute, where)


def registry_problems(files: dict[str, Any]) -> list[str]:
    """Everything Weaver's schema and resolution rules refuse in a set of group files."""
    problems: list[str] = []
    groups = []
    for name, doc in files.items():
        if not isinstance(doc, dict) or set(doc) - {"groups", "imports"} or not isinstance(doc.get("groups"), list):
            problems.append(f"{name}: a group file is a mapping with a groups list")
            continue
        groups += doc["groups"]
    for group in groups:
        problems += group_problems(group)
    ids = [g.get("id") for g in groups if isinstance(g, dict)]
    problems += [f"group id {i} is not unique" for i in {i for i in ids if ids.count(i) > 1}]
    defined = [a["id"] for g in groups if isinstance(g, dict) for a in g.get("attributes", []) if "id" in a]
    problems += [f"attribute {i} is defined twice" for i in {i for i in defined if defined.count(i) > 1}]
    for group in groups:
        if isinstance(group, dict) and "extends" in group and group["extends"] not in ids:
            problems.append(f"{group['id']}: extends unknown group {group['extends']}")
        for attribute in group.get("attributes", []) if isinstance(group, dict) else ():
            ref = attribute.get("ref") if isinstance(attribute, dict) else None
            if ref is not None and ref not in defined and ref not in EXTERNAL:
                problems.append(f"{group['id']}: ref {ref} resolves to nothing")
    return problems


# --------------------------------------------------------------------------- the shipped registry
@functools.cache
def group_files() -> dict[str, Any]:
    """The parsed group files (shared: copy before editing)."""
    return {
        str(path.relative_to(REGISTRY)): yaml.safe_load(path.read_text())
        for path in sorted(REGISTRY.rglob("*.yaml"))
        if path.name != "manifest.yaml"
    }


def groups(kind: str | None = None) -> list[dict[str, Any]]:
    return [g for doc in group_files().values() for g in doc["groups"] if kind is None or g["type"] == kind]


def definitions() -> dict[str, dict[str, Any]]:
    return {a["id"]: a for g in groups() for a in g.get("attributes", []) if "id" in a}


def refs(group: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The attributes a group references, its extended group's included."""
    own = {a["ref"]: a for a in group.get("attributes", []) if "ref" in a}
    if "extends" in group:
        (base,) = [g for g in groups() if g["id"] == group["extends"]]
        own = {**refs(base), **own}
    return own


def text(value: str) -> str:
    return " ".join(value.split())


def test_the_group_files_follow_weavers_schema_and_resolve() -> None:
    files = group_files()
    assert set(files) == {"hicache/registry.yaml", "hicache/metrics.yaml", "hicache/spans.yaml"}
    assert registry_problems(files) == []


BROKEN: list[tuple[str, Any]] = [
    ("a group without stability", lambda g: g["metric"].pop("stability")),
    ("an instrument semantic conventions do not name", lambda g: g["metric"].update(instrument="observable_counter")),
    ("a ref that sets a type", lambda g: g["metric"]["attributes"][0].update(type="string")),
    ("a ref to nothing", lambda g: g["metric"]["attributes"][0].update(ref="hicache.nothing")),
    ("an unknown requirement level", lambda g: g["metric"]["attributes"][0].update(requirement_level="sometimes")),
    ("an enum member without stability", lambda g: g["attribute"]["type"]["members"][0].pop("stability")),
    ("a string attribute without examples", lambda g: g["string"].pop("examples")),
    ("a span without a kind", lambda g: g["span"].pop("span_kind")),
    ("a key the schema does not know", lambda g: g["metric"].update(buckets=[1.0])),
]


@pytest.mark.parametrize(("fault", "edit"), BROKEN, ids=[f for f, _ in BROKEN])
def test_the_schema_check_refuses_each_broken_registry(fault: str, edit: Any) -> None:
    """The check can fail: each of these edits of the shipped files is refused."""
    files = copy.deepcopy(group_files())
    every = [g for doc in files.values() for g in doc["groups"]]
    picks = {
        "metric": next(g for g in every if g["type"] == "metric"),
        "span": next(g for g in every if g["type"] == "span"),
        "attribute": next(a for g in every for a in g.get("attributes", []) if isinstance(a.get("type"), dict)),
        "string": next(a for g in every for a in g.get("attributes", []) if a.get("type") == "string"),
    }
    edit(picks)
    assert registry_problems(files), fault


def test_the_manifest_is_a_definition_manifest_of_this_version() -> None:
    manifest = yaml.safe_load((REGISTRY / "manifest.yaml").read_text())
    assert set(manifest) <= MANIFEST_KEYS and "schema_url" in manifest
    assert manifest["stability"] == "development"
    url = urlparse(manifest["schema_url"])
    assert url.scheme == "https" and url.hostname and url.path.rstrip("/").rsplit("/", 1)[-1] == __version__
    (dependency,) = manifest["dependencies"]  # Weaver supports at most one dependency
    assert set(dependency) <= {"schema_url", "registry_path"}
    dep_url = urlparse(dependency["schema_url"])
    assert dep_url.scheme == "https" and dep_url.hostname and dep_url.path.count("/") >= 2  # a path with a version
    assert "semantic-conventions-genai" in dependency["registry_path"]  # where gen_ai.* is defined today


# --------------------------------------------------------------------------- equal to semconv.py
#: How each semconv kind is written in the conventions (which name the synchronous instruments).
INSTRUMENT_OF = {
    "counter": "counter",
    "histogram": "histogram",
    "observable_up_down_counter": "updowncounter",
    "observable_gauge": "gauge",
}


def test_every_instrument_is_a_metric_with_its_kind_unit_attributes_description_and_buckets() -> None:
    metrics = {g["metric_name"]: g for g in groups("metric")}
    assert set(metrics) == {spec.name for spec in sc.INSTRUMENTS}
    for spec in sc.INSTRUMENTS:
        metric = metrics[spec.name]
        assert metric["id"] == f"metric.{spec.name}"
        assert metric["instrument"] == INSTRUMENT_OF[spec.kind], spec.name
        assert metric["unit"] == spec.unit, spec.name
        assert text(metric["brief"]) == text(spec.description), spec.name
        assert list(refs(metric)) == list(spec.attributes), spec.name  # the closed attribute set, in order
        buckets = metric.get("annotations", {}).get("otel_hicache", {}).get("histogram_buckets")
        assert (tuple(buckets) if buckets else None) == spec.buckets, spec.name


#: Every closed value set of semconv.py and the attribute that carries it.
VALUE_SETS: dict[str, set[str]] = {
    sc.ATTR_OPERATION: {m.value for m in sc.TransferOperation},
    sc.ATTR_POOL: {*sc.POOLS, sc.OTHER_POOL},
    sc.ATTR_SLOT_STATE: {m.value for m in sc.SlotState},
    sc.ATTR_TIER: {m.value for m in sc.Tier},
    sc.ATTR_CAPACITY_FACTOR: set(sc.CAPACITY_FACTORS),
    sc.ATTR_DROP_REASON: {m.value for m in sc.DropReason},
    sc.ATTR_PREFILL_MODE: {m.value for m in sc.PrefillMode},
    sc.ATTR_TIMING_SOURCE: {m.value for m in sc.TimingSource},
    sc.ATTR_RECORD_KIND: {m.value for m in sc.RecordKind},
    sc.ATTR_PROBLEM: {m.value for m in sc.Problem},
    sc.ATTR_INSTRUMENT: {spec.name for spec in sc.INSTRUMENTS},
    sc.RESOURCE_ENGINE: {m.value for m in sc.Engine},
}
#: The other attributes' types.
TYPES = {
    sc.ATTR_EVICTION_REUSED: "boolean",
    sc.ATTR_TOKENS: "int",
    sc.ATTR_BYTES: "int",
    sc.ATTR_POOL_TOKENS: "template[int]",
    sc.ATTR_POOL_BYTES: "template[int]",
    sc.ATTR_MERGED_OPS: "int",
    sc.ATTR_NODES: "int",
    sc.ATTR_COPY_DURATION: "double",
    sc.ATTR_WRITE_POLICY: "string",
    sc.ATTR_IO_BACKEND: "string",
    sc.ATTR_PREFIX_TOKENS: "template[int]",
    sc.ATTR_KV_WAIT: "template[double]",
    sc.RESOURCE_TP_RANK: "int",
    sc.RESOURCE_PP_RANK: "int",
    sc.RESOURCE_DP_RANK: "int",
    sc.RESOURCE_ATTN_TP_RANK: "int",
}


def test_every_attribute_key_is_in_the_registry_with_its_type_or_closed_value_set() -> None:
    keys = {value for name, value in vars(sc).items() if name.startswith(("ATTR_", "RESOURCE_"))}
    assert keys == set(VALUE_SETS) | set(TYPES) | {sc.ATTR_ERROR_TYPE}, "a new semconv attribute: add it here"
    defined = definitions()
    assert set(defined) == keys - set(EXTERNAL)  # nothing more, nothing less
    for key, values in VALUE_SETS.items():
        assert {m["value"] for m in defined[key]["type"]["members"]} == values, key
    for key, kind in TYPES.items():
        assert defined[key]["type"] == kind, key
    assert set(defined[sc.ATTR_WRITE_POLICY]["examples"]) == {p.value for p in sc.WritePolicy}


def test_every_closed_value_set_of_semconv_is_an_attribute_of_the_registry() -> None:
    enums = {v for v in vars(sc).values() if isinstance(v, type) and issubclass(v, enum.Enum) and list(v)}
    covered = {frozenset(values) for values in VALUE_SETS.values()}
    # write policies: a free string on spans, whose examples are the enum; Feed: how the pipeline reads an instrument
    for cls in enums - {sc.WritePolicy, sc.Feed}:
        assert frozenset(m.value for m in cls) in covered, cls.__name__


def test_transfer_spans_are_the_span_names_with_the_attributes_a_transfer_span_carries() -> None:
    spans = {g["id"].removeprefix("span."): g for g in groups("span")}
    transfers = {name: g for name, g in spans.items() if name != "hicache.request"}
    assert set(transfers) == set(sc.SPAN_NAMES.values())
    record = TransferRecord(
        operation=sc.TransferOperation.BACKUP,
        tokens_by_pool={"kv": 8},
        num_bytes=64,
        submit_time_ns=1,
        complete_time_ns=2,
        copy_duration_s=0.001,
        timing_source=sc.TimingSource.HOST_CLOCK,
        bytes_by_pool={"kv": 64},
        write_policy="write_back",
        io_backend="direct",
    )
    carried = {template_of(key) for key in transfer_span_attributes(record)}
    for name, span in transfers.items():
        assert span["span_kind"] == "internal" and set(refs(span)) == carried, name


def template_of(key: str) -> str:
    """The template a per-pool key is an instance of (``hicache.transfer.tokens.kv``), else the key itself."""
    for template in (sc.ATTR_POOL_TOKENS, sc.ATTR_POOL_BYTES):
        if key.startswith(f"{template}."):
            return template
    return key


def test_no_attribute_name_is_also_a_namespace() -> None:
    names = {key for key, attribute in definitions().items() if not str(attribute["type"]).startswith("template")}
    names |= set(EXTERNAL)
    for name in names:
        assert not [other for other in names | set(definitions()) if other.startswith(f"{name}.")], name


def test_the_request_span_has_the_split_and_waits_and_references_gen_ai() -> None:
    (request,) = [g for g in groups("span") if g["id"] == "span.hicache.request"]
    attributes = refs(request)
    assert {sc.ATTR_PREFIX_TOKENS, sc.ATTR_KV_WAIT} <= set(attributes)
    assert {key for key in attributes if key.startswith("gen_ai.")} == {k for k in EXTERNAL if k.startswith("gen_ai.")}
    assert not [key for key in definitions() if key.startswith("gen_ai.")]  # referenced, never redefined


def test_everything_is_in_development() -> None:
    for group in groups():
        assert group.get("stability", "development") == "development", group["id"]
        for attribute in group.get("attributes", []):
            if "id" in attribute:
                assert attribute["stability"] == "development", attribute["id"]
                members = attribute["type"].get("members", []) if isinstance(attribute["type"], dict) else []
                assert all(m["stability"] == "development" for m in members), attribute["id"]
