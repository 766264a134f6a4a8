"""The metric groups of ``registry/hicache/metrics.yaml`` and the instrument table of ``docs/vocabulary.md``, written
from the rows of :data:`otel_hicache.semconv.INSTRUMENTS`: a new row is a new group and a new table line.

    python -m otel_hicache.testing.vocabulary           # rewrite both from the rows
    python -m otel_hicache.testing.vocabulary --check   # exit 1 when either is not what the rows say

Everything comes from the row (name, kind, unit, description as the brief, attributes in order, optional ones as
conditionally required, histogram buckets as the ``otel_hicache.histogram_buckets`` annotation), except prose the
registry has beyond it: a group's ``note`` (:data:`NOTES`), the condition under which an optional attribute is present
(:data:`CONDITIONS`, a generic one otherwise) and an attribute's note in one group (:data:`ATTRIBUTE_NOTES`). A row
needs none of them. ``tests/test_vocabulary.py`` keeps the files equal to what this writes.
"""

from __future__ import annotations

import json
import re
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path

from otel_hicache import semconv as sc

ROOT = Path(__file__).parents[3]  # the clone (this file: src/otel_hicache/testing/)
METRICS_YAML = ROOT / "registry" / "hicache" / "metrics.yaml"
VOCABULARY_MD = ROOT / "docs" / "vocabulary.md"
#: The instrument table of docs/vocabulary.md stands between these lines.
TABLE_START = "<!-- instrument table: written by python -m otel_hicache.testing.vocabulary from semconv.INSTRUMENTS -->"
TABLE_END = "<!-- end of the instrument table -->"
WIDTH = 120

#: How each semconv kind is written in the conventions (which name the synchronous instruments).
INSTRUMENT_OF = {
    "counter": "counter",
    "histogram": "histogram",
    "observable_up_down_counter": "updowncounter",
    "observable_gauge": "gauge",
}
#: A group's note, by instrument.
NOTES = {
    sc.METRIC_TRANSFER_TOKENS: "Logical: the same on every tensor-parallel rank, so one rank per TP x PP group "
    'reports it and a sum over processes is the logical token flow. Mamba "tokens" are state slots.',
    sc.METRIC_TRANSFER_SIZE: "Per-rank shards: every rank reports its own bytes.",
    sc.METRIC_WASTED_SIZE: "With `hicache.transfer.size` of the same operation it gives the wasted share of what that "
    "operation wrote.",
    sc.METRIC_REQUEST_KV_WAIT: "Exemplars link a point to the request's trace; the request span carries the same "
    "value as `hicache.kv_wait.<tier>`.",
    sc.METRIC_CAPACITY_HIT_RATIO: "Reported from observable callbacks (an asynchronous gauge), about once a second, "
    "from a fixed-size SHARDS estimator over each admitted request's prefix lookup (keys stay in the process).",
    sc.METRIC_PREFILL_TOKENS: "The hits of all tiers together are what `gen_ai.usage.cache_read.input_tokens` counts "
    "per request, and all modes together what `gen_ai.usage.input_tokens` counts.",
}
#: The note of every asynchronous up-down counter (pool gauges).
OBSERVABLE_NOTE = "Reported from observable callbacks (an asynchronous up-down counter), about once a second."
#: When an optional attribute (a row's ``optional``) is present, by (instrument, attribute).
CONDITIONS = {
    (sc.METRIC_TRANSFER_SIZE, sc.ATTR_POOL): "Where the producer knows the bytes of each pool.",
    (sc.METRIC_EVICTION_TOKENS, sc.ATTR_EVICTION_REUSED): "Where the producer knows whether each evicted entry "
    "served a hit in the tier.",
}
GENERIC_CONDITION = "Where the producer reports it."
#: An attribute's note in one group, by (instrument, attribute).
ATTRIBUTE_NOTES = {
    (sc.METRIC_REQUEST_KV_WAIT, sc.ATTR_TIER): "`host` or `storage`: the device serves no wait.",
}
HEADER = """\
# One group per instrument. Counters are exported as observable counters reading exact accumulators (semantic
# conventions name the synchronous kind); histogram buckets, which the conventions leave to advice, are the
# annotation otel_hicache.histogram_buckets: what its Views install.
# Written by python -m otel_hicache.testing.vocabulary from semconv.INSTRUMENTS: edit the rows, not this file.
"""


def metrics_yaml(instruments: Sequence[sc.InstrumentSpec]) -> str:
    """The group file: one ``metric`` group per row."""
    return HEADER + "groups:\n" + "\n".join(_group(spec) for spec in instruments)


def vocabulary_table(instruments: Sequence[sc.InstrumentSpec]) -> list[str]:
    """The instrument table of docs/vocabulary.md, one line per row."""
    lines = ["| instrument | kind, unit | attributes |", "|---|---|---|"]
    for spec in instruments:
        attributes = ", ".join(f"`{a}`" for a in spec.attributes)
        lines.append(f"| `{spec.name}` | {spec.kind.replace('_', ' ')}, `{spec.unit}` | {attributes} |")
    return lines


def vocabulary_md(instruments: Sequence[sc.InstrumentSpec], page: str) -> str:
    """``page`` (docs/vocabulary.md) with its instrument table written from ``instruments``."""
    before, start, rest = page.partition(TABLE_START + "\n")
    _, end, after = rest.partition(TABLE_END + "\n")
    if not start or not end:
        raise ValueError(f"{VOCABULARY_MD.name} lacks the table's marker lines")
    return before + start + "\n".join(vocabulary_table(instruments)) + "\n" + end + after


def _group(spec: sc.InstrumentSpec) -> str:
    lines = [
        f"  - id: metric.{spec.name}",
        "    type: metric",
        f"    metric_name: {spec.name}",
        f"    instrument: {INSTRUMENT_OF[spec.kind]}",
        f"    unit: {_scalar(spec.unit)}",
        "    stability: development",
        *_text("brief", spec.description, 4),
    ]
    note = NOTES.get(spec.name, OBSERVABLE_NOTE if spec.kind == "observable_up_down_counter" else None)
    if note:
        lines += _text("note", note, 4)
    if spec.buckets:
        buckets = ", ".join(map(str, spec.buckets))
        lines += ["    annotations:", "      otel_hicache:", f"        histogram_buckets: [{buckets}]"]
    lines.append("    attributes:")
    for attribute in spec.attributes:
        lines.append(f"      - ref: {attribute}")
        if attribute in spec.optional:
            condition = CONDITIONS.get((spec.name, attribute), GENERIC_CONDITION)
            lines += ["        requirement_level:", *_text("conditionally_required", condition, 10)]
        else:
            lines.append("        requirement_level: required")
        if attribute == sc.ATTR_ERROR_TYPE:  # the closed set semconv declares, as the conventions document one
            errors = sorted(sc.TRANSFER_ERRORS)
            listed = ", ".join(f"`{e}`" for e in errors)
            lines += _text("note", f"One of {listed}; any other value is reported as `{sc.OTHER_ERROR}`.", 8)
            lines.append(f"        examples: {json.dumps(errors[:2])}")
        elif (spec.name, attribute) in ATTRIBUTE_NOTES:
            lines += _text("note", ATTRIBUTE_NOTES[(spec.name, attribute)], 8)
    return "\n".join(lines) + "\n"


def _text(key: str, value: str, indent: int) -> list[str]:
    """``key: value`` on one line when it fits, else a folded block wrapped at :data:`WIDTH`."""
    one = f"{' ' * indent}{key}: {_scalar(value)}"
    if len(one) <= WIDTH:
        return [one]
    body = textwrap.wrap(value, WIDTH - indent - 2, break_long_words=False, break_on_hyphens=False)
    return [f"{' ' * indent}{key}: >", *(f"{' ' * (indent + 2)}{line}" for line in body)]


def _scalar(value: str) -> str:
    """A plain YAML scalar where one reads back as the same string, else a double-quoted one."""
    plain = re.fullmatch(r"[A-Za-z0-9(][^#]*", value) and ": " not in value and not value.endswith(":")
    plain = plain and not re.fullmatch(r"[-+.0-9eE]+", value)  # a number reads back as one, not as a string
    return value if plain else json.dumps(value)


def main(argv: Sequence[str], root: Path = ROOT, instruments: Sequence[sc.InstrumentSpec] | None = None) -> int:
    """Rewrite the two files under ``root`` from ``instruments`` (semconv's rows by default), or with ``--check``
    only say which are stale (exit status 1)."""
    rows = sc.INSTRUMENTS if instruments is None else instruments
    yaml_path, page_path = root / METRICS_YAML.relative_to(ROOT), root / VOCABULARY_MD.relative_to(ROOT)
    wanted = {yaml_path: metrics_yaml(rows), page_path: vocabulary_md(rows, page_path.read_text())}
    stale = [path for path, text in wanted.items() if path.read_text() != text]
    for path in stale:
        if "--check" in argv:
            print(f"{path.relative_to(root)} is not what semconv.INSTRUMENTS says: run python -m {__name__}")
        else:
            path.write_text(wanted[path])
            print(f"wrote {path.relative_to(root)}")
    return 1 if stale and "--check" in argv else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
