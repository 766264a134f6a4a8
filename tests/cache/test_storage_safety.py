"""The L3 store serves only the page and model an entry was written for, and no storage fault raises into admit.

Every fault is real: entry files moved, directories planted, a 300 MiB sparse file, and permission bits obeyed by
a child process that runs without root's file-permission override (setpriv drops CAP_DAC_OVERRIDE and
CAP_DAC_READ_SEARCH), so the PermissionError it meets comes from the kernel.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from otel_hicache import semconv as sc
from otel_hicache.cache.content import page_hashes
from otel_hicache.cache.hicache import HiCache
from otel_hicache.cache.pools import PoolGroup
from otel_hicache.cache.storage import FileStore, StorageJob
from otel_hicache.semconv import Tier, TransferOperation
from otel_hicache.testing.sdk import make_sdk
from tests.cache.support import POOLS, expected_value, read_value, small_config, verify_tree

REPO = Path(__file__).parents[2]
PS = 4
PROMPT = list(range(2000, 2040))  # 10 pages, each in a shard directory of its own
NAMES = page_hashes(PROMPT, PS)
EXTRA = [1, 2, 3, 4]  # one more page, so the prompt's last page is a prefix hit
K = 5  # the page every fault is put on: pages 0..K-1 are served from L3, the rest recomputed
READ_FAILED = "storage_prefetch/storage_read_failed"
WRITE_FAILED = "storage_backup/storage_write_failed"


def test_the_prompt_puts_each_page_in_its_own_shard() -> None:  # so a shard fault touches page K only
    assert len({name[:2] for name in NAMES}) == len(NAMES)


def _failures(telemetry: Any) -> dict[str, int]:
    return {f"{op}/{err}": n for (op, err), n in telemetry.snapshot()[sc.METRIC_TRANSFER_FAILURES].items() if n}


def _store_prompt(root: Path, **overrides: Any) -> Path:
    """Back the prompt up to L3 under ``root`` with a cache that then closes; the path of page K's entry."""
    sdk = make_sdk(pools=[p.name for p in POOLS])
    cache = HiCache(small_config(root, **overrides), sdk.telemetry)
    try:
        cache.release(cache.admit(PROMPT))
        cache.flush()
        assert cache.store is not None and cache.store.hit_pages(NAMES) == len(NAMES)
        return cache.store._path(NAMES[K])
    finally:
        cache.close()
        sdk.telemetry.shutdown()


def admit_after_fault(root: str, **overrides: Any) -> dict[str, Any]:
    """A fresh cache over ``root`` admits the prompt and one more page; what it served and counted (JSON-able).

    Any exception out of ``admit`` or the lookups fails the caller (in a child process: a non-zero exit).
    """
    sdk = make_sdk(pools=[p.name for p in POOLS])
    cache = HiCache(small_config(Path(root), **overrides), sdk.telemetry)
    try:
        assert cache.store is not None
        admission = cache.admit(PROMPT + EXTRA)
        hit_after_admit = cache.store.hit_pages(NAMES)  # before the recomputed pages are backed up again
        failures_after_admit = _failures(sdk.telemetry)
        cache.release(admission)
        cache.flush()
        checked = verify_tree(cache)  # every copy in the tree is the model's KV for its page
        served = admission.nodes[0]  # the node prefetched from L3, loaded back to the device
        assert served.device is not None
        assert torch.equal(read_value(cache.device, served.device, "kv"), expected_value(cache, "kv", served.names))
        return {
            "split": admission.split._asdict(),
            "hit_after_admit": hit_after_admit,
            "failures_after_admit": failures_after_admit,
            "hit_after_backup": cache.store.hit_pages(NAMES),
            "failures": _failures(sdk.telemetry),
            "checked": checked["device/kv"],
        }
    finally:
        cache.close()
        sdk.telemetry.shutdown()


def _child(function: str, *args: str, drop_dac: bool = False) -> dict[str, Any]:
    """Run ``function(*args)`` of this module in a child process (without root's DAC override if asked)."""
    command = [
        sys.executable,
        "-c",
        f"import json, sys; from {__name__} import {function} as f; print(json.dumps(f(*sys.argv[1:])))",
        *args,
    ]
    if drop_dac and os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("running as root and setpriv (util-linux) is missing: cannot drop CAP_DAC_OVERRIDE")
        command = [setpriv, "--bounding-set=-dac_override,-dac_read_search", "--", *command]
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result: dict[str, Any] = json.loads(proc.stdout.splitlines()[-1])
    return result


SERVED_UP_TO_K = {
    "input_tokens": len(PROMPT) - K * PS + len(EXTRA),
    "device_hit": 0,
    "host_hit": 0,
    "storage_hit": K * PS,
}


# ---------------------------------------------------------------------------------------------- wrong KV
@pytest.mark.parametrize("source", ["another page", "the same page of another model"])
def test_a_swapped_entry_is_a_counted_miss_never_served(tmp_path, source: str) -> None:
    entry = _store_prompt(tmp_path)
    if source == "another page":
        stranger = entry.parent.parent / NAMES[3][:2] / f"{NAMES[3]}.kv"
    else:
        stranger = _store_prompt(tmp_path, seed=1)  # model 1's page K, a whole and checksum-valid entry
    assert stranger != entry and stranger.stat().st_size == entry.stat().st_size
    shutil.copyfile(stranger, entry)

    seen = admit_after_fault(str(tmp_path))

    assert seen["split"] == SERVED_UP_TO_K  # the prefix split reports only what was served
    assert seen["failures_after_admit"] == {READ_FAILED: 1}
    assert seen["hit_after_admit"] == K  # the false hit is withdrawn, and not counted again
    assert seen["hit_after_backup"] == len(NAMES)  # the recomputed page K was backed up in its place
    assert seen["failures"] == {READ_FAILED: 1}
    assert seen["checked"] > 0


@pytest.mark.parametrize(
    "other",
    [
        {"seed": 1},  # another model
        {"pools": (dataclasses.replace(POOLS[0], dtype=torch.bfloat16), *POOLS[1:])},  # same bytes, other dtype
        {"pools": (dataclasses.replace(POOLS[0], head_dim=16), *POOLS[1:])},  # another layout
    ],
    ids=["model", "dtype", "layout"],
)
def test_two_namespaces_share_one_root_and_never_see_each_others_pages(csdk, tmp_path, other: dict) -> None:
    _store_prompt(tmp_path)  # model A

    b = admit_after_fault(str(tmp_path), **other)
    assert b["split"] == {"input_tokens": len(PROMPT + EXTRA), "device_hit": 0, "host_hit": 0, "storage_hit": 0}
    assert b["hit_after_admit"] == 0 and b["hit_after_backup"] == len(NAMES)  # B's own pages, beside A's
    assert b["failures"] == {}
    assert len([p for p in tmp_path.iterdir() if p.is_dir()]) == 2

    a = HiCache(small_config(tmp_path), csdk.telemetry)  # model A again: its pages are intact and still its own
    try:
        admission = a.admit(PROMPT + EXTRA)
        assert admission.split.storage_hit == len(PROMPT)
        a.release(admission)
        a.flush()
        assert verify_tree(a)["device/kv"] > 0
    finally:
        a.close()
    assert _failures(csdk.telemetry) == {}


# ---------------------------------------------------------------------------------------------- silent loss
def test_a_directory_at_an_entry_path_fails_the_backup_and_is_never_a_hit(csdk, tmp_path) -> None:
    cache = HiCache(small_config(tmp_path), csdk.telemetry)
    try:
        assert cache.store is not None
        blocker = cache.store._path(NAMES[K])
        blocker.mkdir(parents=True)
        (blocker / "not ours").write_bytes(b"x")  # a non-empty directory: nothing of it is deleted
        cache.release(cache.admit(PROMPT))
        cache.flush()
        assert cache.store.stats.slots[("storage_backup", "kv")] == K * PS  # only the pages that landed
        assert _failures(csdk.telemetry) == {WRITE_FAILED: 1}
        assert cache.store.hit_pages(NAMES) == K
        cache.evict_device(10_000)
        cache.evict_host(10_000)
        assert cache.match_prefix(PROMPT) == (0, 0, K * PS)
        admission = cache.admit(PROMPT + EXTRA)
        assert admission.split._asdict() == SERVED_UP_TO_K
        cache.release(admission)
        cache.flush()
        assert verify_tree(cache)["device/kv"] > 0
        assert _failures(csdk.telemetry) == {WRITE_FAILED: 2}  # the recomputed page K could not land either
        assert (blocker / "not ours").read_bytes() == b"x"
    finally:
        cache.close()


def test_an_empty_directory_in_place_of_an_entry_is_a_counted_miss_then_cleaned_up(tmp_path) -> None:
    entry = _store_prompt(tmp_path)
    entry.unlink()
    entry.mkdir()

    seen = admit_after_fault(str(tmp_path))

    assert seen["split"] == SERVED_UP_TO_K
    assert seen["failures_after_admit"] == {READ_FAILED: 1} and seen["hit_after_admit"] == K
    assert seen["hit_after_backup"] == len(NAMES) and entry.is_file()  # the backup replaced the directory
    assert seen["failures"] == {READ_FAILED: 1}


def test_an_unreadable_entry_is_a_counted_miss_and_the_false_hit_is_withdrawn(tmp_path) -> None:
    entry = _store_prompt(tmp_path)
    entry.chmod(0)
    entry.parent.chmod(0o555)  # nor can it be deleted or rewritten
    try:
        seen = _child("admit_after_fault", str(tmp_path), drop_dac=True)
        denied = _child("permission_denied", str(entry), drop_dac=True)
    finally:
        entry.parent.chmod(0o755)
    assert denied == {"open": "PermissionError"}
    assert seen["split"] == SERVED_UP_TO_K
    assert seen["failures_after_admit"] == {READ_FAILED: 1}
    assert seen["hit_after_admit"] == K  # the entry is still there, but no longer reported
    assert seen["hit_after_backup"] == K
    assert seen["failures"] == {READ_FAILED: 1, WRITE_FAILED: 1}  # the recomputed page could not land


def test_an_unsearchable_shard_directory_is_a_counted_miss_not_an_exception_in_admit(tmp_path) -> None:
    entry = _store_prompt(tmp_path)
    entry.parent.chmod(0o600)  # listable, but nothing in it can be looked up
    try:
        seen = _child("admit_after_fault", str(tmp_path), drop_dac=True)
        denied = _child("permission_denied", str(entry), drop_dac=True)
    finally:
        entry.parent.chmod(0o755)
    assert denied == {"open": "PermissionError"}
    assert seen["split"] == SERVED_UP_TO_K
    assert seen["failures_after_admit"] == {READ_FAILED: 1}  # the lookup, counted once
    assert seen["hit_after_admit"] == seen["hit_after_backup"] == K
    assert seen["failures"] == {READ_FAILED: 1, WRITE_FAILED: 1}


def permission_denied(path: str) -> dict[str, str]:
    """In the child: proof that its PermissionError is the kernel's."""
    try:
        with open(path, "rb"):
            return {"open": "allowed"}
    except OSError as exc:
        return {"open": type(exc).__name__}


# ---------------------------------------------------------------------------------------------- hardening
@pytest.mark.parametrize("name", ["../../x", "ab/../../../x", "/tmp/x", "..", "AB" * 16, "a", "0" * 65, "ab.kv"])
def test_a_name_that_is_not_a_page_hash_is_refused_and_nothing_leaves_the_store(csdk, tmp_path, name: str) -> None:
    root = tmp_path / "deep" / "l3"
    host = PoolGroup(Tier.HOST, POOLS, token_slots=64, node_slots=4, page_size=PS, device="cpu")
    store = FileStore(root, host, csdk.telemetry, model="m")
    value, _ = host.alloc(2, False)
    assert value is not None
    backup = StorageJob(TransferOperation.STORAGE_BACKUP, 1, [NAMES[0], name], value)
    prefetch = StorageJob(TransferOperation.STORAGE_PREFETCH, 2, [name], value)
    assert not store.submit(backup) and backup.done.is_set() and backup.pages_done == 0
    assert not store.submit(prefetch) and prefetch.pages_done == 0
    assert store.hit_pages([name]) == 0 and not store.contains(name)
    store.shutdown()
    assert _failures(csdk.telemetry) == {WRITE_FAILED: 1, READ_FAILED: 3}
    assert [p.relative_to(tmp_path) for p in tmp_path.rglob("*")] == [Path("deep"), Path("deep/l3")]


def test_an_oversized_entry_is_a_counted_miss_and_is_replaced(tmp_path) -> None:
    entry = _store_prompt(tmp_path)
    os.truncate(entry, 300 << 20)  # sparse: no disk, but 300 MiB if anything read it whole

    seen = admit_after_fault(str(tmp_path))

    assert seen["split"] == SERVED_UP_TO_K
    assert seen["failures_after_admit"] == {READ_FAILED: 1} and seen["hit_after_admit"] == K
    assert seen["hit_after_backup"] == len(NAMES) and entry.stat().st_size < 1 << 20
    assert seen["failures"] == {READ_FAILED: 1}


def test_an_oversized_entry_is_refused_by_its_size_before_any_of_it_is_read(tmp_path) -> None:
    seen = _child("prefetch_oversized", str(tmp_path))
    assert seen["pages_done"] == 1  # the page before it
    assert seen["failures"] == {READ_FAILED: 1}
    assert seen["entry_left"] is False  # the rogue file is deleted
    assert seen["peak_rss_growth_mib"] < 32  # reading it whole would be >= 300


def prefetch_oversized(root: str) -> dict[str, Any]:
    """In the child: a direct prefetch (no lookup first) of three pages whose second entry is 300 MiB."""
    sdk = make_sdk(pools=[p.name for p in POOLS])
    host = PoolGroup(Tier.HOST, POOLS, token_slots=64, node_slots=4, page_size=PS, device="cpu")
    store = FileStore(root, host, sdk.telemetry, model="m")
    value, _ = host.alloc(3, False)
    assert value is not None
    backup = StorageJob(TransferOperation.STORAGE_BACKUP, 1, NAMES[:3], value)
    assert store.submit(backup) and backup.done.wait(30) and backup.pages_done == 3
    entry = store._path(NAMES[1])
    os.truncate(entry, 300 << 20)
    job = StorageJob(TransferOperation.STORAGE_PREFETCH, 2, NAMES[:3], value)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak resident set size (VmHWM) to the current one
    baseline = _vm_kib("VmRSS")
    assert store.submit(job) and job.done.wait(30)
    peak = _vm_kib("VmHWM")
    store.shutdown()
    result = {
        "pages_done": job.pages_done,
        "failures": _failures(sdk.telemetry),
        "entry_left": entry.exists(),
        "peak_rss_growth_mib": (peak - baseline) / 1024,
    }
    sdk.telemetry.shutdown()
    return result


def _vm_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))
