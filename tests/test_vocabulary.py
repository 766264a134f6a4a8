"""Adding a metric costs one semconv row plus its producer: the registry's metric group and the vocabulary's table
line are written from the row (``python -m otel_hicache.testing.vocabulary``), and docs/architecture.md names every
other place a new metric touches."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import yaml

from otel_hicache import semconv as sc
from otel_hicache.testing import vocabulary
from tests.test_registry import registry_problems

ROOT = Path(__file__).parents[1]

#: Two rows a maintainer might add: a counter with an optional attribute and seeds, a histogram fed by points.
NEW_ROWS = (
    sc.InstrumentSpec(
        "hicache.prefetch.aborted",
        "counter",
        sc.UNIT_TOKEN,
        "Tokens of storage prefetches aborted before they completed: the request went ahead without them.",
        (sc.ATTR_TIER, sc.ATTR_POOL),
        optional=(sc.ATTR_POOL,),
        seeds=((sc.Tier.STORAGE,), (None,)),
    ),
    sc.InstrumentSpec(
        "hicache.transfer.queue_wait",
        "histogram",
        sc.UNIT_SECOND,
        "Time a merged transfer waited in its queue before its copy started.",
        (sc.ATTR_OPERATION,),
        (0.001, 0.1, 1.0),
        feed=sc.Feed.POINTS,
    ),
)


def test_the_registry_and_the_vocabulary_are_what_the_rows_say() -> None:
    assert vocabulary.main(["--check"]) == 0, "run python -m otel_hicache.testing.vocabulary"


def test_a_metric_added_by_its_row_alone_is_in_the_registry_and_the_vocabulary(tmp_path: Path) -> None:
    """In a copy of registry/ and docs/: the command, given the rows with two more, rewrites both files; the new
    groups pass Weaver's rules and the new table lines are what the vocabulary test reads."""
    shutil.copytree(ROOT / "registry", tmp_path / "registry")
    (tmp_path / "docs").mkdir()
    shutil.copy(ROOT / "docs" / "vocabulary.md", tmp_path / "docs" / "vocabulary.md")
    rows = (*sc.INSTRUMENTS, *NEW_ROWS)
    assert vocabulary.main(["--check"], tmp_path, rows) == 1  # stale until written
    assert vocabulary.main([], tmp_path, rows) == 0
    assert vocabulary.main(["--check"], tmp_path, rows) == 0

    files = {
        str(p.relative_to(tmp_path / "registry")): yaml.safe_load(p.read_text())
        for p in (tmp_path / "registry").rglob("*.yaml")
        if p.name != "manifest.yaml"
    }
    assert registry_problems(files) == []
    groups = {g["metric_name"]: g for g in files["hicache/metrics.yaml"]["groups"]}
    aborted, wait = groups["hicache.prefetch.aborted"], groups["hicache.transfer.queue_wait"]
    assert (aborted["instrument"], aborted["unit"], " ".join(aborted["brief"].split())) == (
        "counter",
        "{token}",
        NEW_ROWS[0].description,
    )
    assert aborted["attributes"] == [
        {"ref": "hicache.tier", "requirement_level": "required"},
        {"ref": "hicache.pool", "requirement_level": {"conditionally_required": vocabulary.GENERIC_CONDITION}},
    ]
    assert wait["instrument"] == "histogram"
    assert wait["annotations"]["otel_hicache"]["histogram_buckets"] == [0.001, 0.1, 1.0]
    assert [g["metric_name"] for g in files["hicache/metrics.yaml"]["groups"]] == [spec.name for spec in rows]

    page = (tmp_path / "docs" / "vocabulary.md").read_text()
    assert "| `hicache.prefetch.aborted` | counter, `{token}` | `hicache.tier`, `hicache.pool` |" in page
    assert "| `hicache.transfer.queue_wait` | histogram, `s` | `hicache.operation` |" in page
    before = (ROOT / "docs" / "vocabulary.md").read_text()
    old_table, new_table = ("\n".join(vocabulary.vocabulary_table(r)) for r in (sc.INSTRUMENTS, rows))
    assert page == before.replace(old_table, new_table)  # nothing else of the page changed


def test_the_prose_beyond_the_rows_belongs_to_rows_that_exist() -> None:
    names = {spec.name: spec for spec in sc.INSTRUMENTS}
    assert set(vocabulary.NOTES) <= set(names)
    for name, attribute in vocabulary.CONDITIONS:
        assert attribute in names[name].optional, (name, attribute)
    for name, attribute in vocabulary.ATTRIBUTE_NOTES:
        assert attribute in names[name].attributes, (name, attribute)


# --------------------------------------------------------------------------- the list of places
def places() -> set[str]:
    """The files docs/architecture.md says a new metric (or a new record kind) touches."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    paragraph = text.split("Adding a metric touches", 1)[1].split("\n\n", 1)[0]
    return set(re.findall(r"`((?:src/otel_hicache|registry|docs|tests)/[\w./]+)`", paragraph))


def modules_matching(pattern: str) -> set[str]:
    """The core's modules (engine adapters, the reference cache and the test helpers are producers or readers of
    their own) whose source matches ``pattern``."""
    found = set()
    for path in sorted((ROOT / "src" / "otel_hicache").rglob("*.py")):
        relative = path.relative_to(ROOT).as_posix()
        if relative.startswith(
            ("src/otel_hicache/integrations/", "src/otel_hicache/cache/", "src/otel_hicache/testing/")
        ):
            continue
        if re.search(pattern, path.read_text()):
            found.add(relative)
    return found


def test_the_architecture_names_every_place_a_new_metric_touches() -> None:
    named = places()
    for path in named:
        assert (ROOT / path).exists(), path
    # the row, the generated files, what writes a metric's slots or queues its points
    assert {"src/otel_hicache/semconv.py", "registry/hicache/metrics.yaml", "docs/vocabulary.md"} <= named
    assert modules_matching(r"slots\[sc\.METRIC_|_put_points\(\s*sc\.METRIC_") <= named
    # a metric of a new record kind: every core module that spells an existing kind's record (the KV wait's)
    assert modules_matching(r"\bKvWait\b|RecordKind\.KV_WAIT\b") <= named
    assert "registry/hicache/registry.yaml" in named  # the new kind's value of otel_hicache.record.kind
