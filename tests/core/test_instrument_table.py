"""Adding an instrument is one row of ``semconv.INSTRUMENTS`` plus the producer call that feeds it: the slot table,
its seeds, the histogram blocks, the Views and the exported instruments all follow from the row.

Shown in a fresh interpreter that adds two rows before the pipeline is imported - a counter with seeds and a
histogram fed by points on two attributes - and feeds them the way a producer method of the telemetry would."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import json
    from otel_hicache import semconv as sc

    sc.INSTRUMENTS = (
        *sc.INSTRUMENTS,
        sc.InstrumentSpec("hicache.test.prefetch.aborted", "counter", sc.UNIT_TOKEN, "Tokens of aborted prefetches.",
                          (sc.ATTR_TIER, sc.ATTR_POOL), seeds=((sc.Tier.STORAGE,), sc.SEED_POOLS)),
        sc.InstrumentSpec("hicache.test.queue.wait", "histogram", sc.UNIT_SECOND, "Time a transfer waited to start.",
                          (sc.ATTR_OPERATION, sc.ATTR_TIER), (0.001, 0.1, 1.0), feed=sc.Feed.POINTS),
    )
    from otel_hicache.testing.sdk import make_sdk

    sdk = make_sdk(pools=("kv", "swa"))
    seeded = sdk.points("hicache.test.prefetch.aborted")
    tally = sdk.telemetry._tally  # what a new record_... method of the telemetry would call
    tally.add([(tally.layout.slots["hicache.test.prefetch.aborted"][("storage", "swa")], 7)])
    for value in (0.05, 0.5):
        tally.observe("hicache.test.queue.wait", (sc.TransferOperation.BACKUP, sc.Tier.HOST), value)
    counted = {str(sorted(k)): p.value for k, p in sdk.points("hicache.test.prefetch.aborted").items()}
    waits = sdk.points("hicache.test.queue.wait")
    waits = {str(sorted(k)): (p.count, list(p.explicit_bounds), list(p.bucket_counts)) for k, p in waits.items()}
    print(json.dumps({"seeded": {str(sorted(k)): p.value for k, p in seeded.items()},
                      "counted": counted, "waits": waits}))
    sdk.shutdown()
    """
)


def test_a_new_row_is_counted_seeded_accumulated_and_exported_with_no_other_change() -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    storage_kv = str(sorted({"hicache.tier": "storage", "hicache.pool": "kv"}.items()))
    storage_swa = str(sorted({"hicache.tier": "storage", "hicache.pool": "swa"}.items()))
    assert got["seeded"] == {storage_kv: 0, storage_swa: 0}  # the row's seeds: storage x the seeded pools
    assert got["counted"] == {storage_kv: 0, storage_swa: 7}
    backup_host = str(sorted({"hicache.operation": "backup", "hicache.tier": "host"}.items()))
    assert got["waits"] == {backup_host: [2, [0.001, 0.1, 1.0], [0, 1, 1, 0]]}  # the row's attributes and buckets
