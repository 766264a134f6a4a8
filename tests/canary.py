"""Looking for a canary - recognisable token ids - where a prompt's ids must never be: the export processes' shared
memory, ``/proc/<pid>/environ`` and ``cmdline``, and whether another user can open that memory.

Shared by the canary tests of SGLang (:mod:`tests.sglang.test_token_ids`) and vLLM (:mod:`tests.vllm.test_token_ids`,
whose engine app looks in its export processes while they live: :mod:`tests.vllm.canary_app`).
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterable

#: The user another user's process runs as.
NOBODY = 65534
#: What the export process's command line names (``python -m otel_hicache._internal.export.boot FDS``).
EXPORT_MODULE = b"otel_hicache._internal.export.boot"


class Canary:
    """Looks for ``spellings`` (bytes) in data."""

    def __init__(self, spellings: Iterable[bytes]) -> None:
        self.spellings = tuple(spellings)

    def found_in(self, data: bytes) -> bool:
        return any(spelling in data for spelling in self.spellings)


def exporter_memfd(pid: int) -> str:
    """The path of the export process's descriptor of the shared memory."""
    for fd in os.listdir(f"/proc/{pid}/fd"):
        if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("/memfd:otel-hicache"):
            return f"/proc/{pid}/fd/{fd}"
    raise AssertionError("the export process maps no otel-hicache memfd")


def opens_as(path: str, uid: int | None) -> bool:
    """Whether a process of user ``uid`` (None: ours) can open ``path`` for reading."""
    return subprocess.run(["/bin/sh", "-c", f"exec 3< {path}"], user=uid, capture_output=True).returncode == 0


def proc_parts(pid: int) -> bytes:
    """``pid``'s ``environ`` and ``cmdline`` as the kernel shows them."""
    return b"".join(open(f"/proc/{pid}/{part}", "rb").read() for part in ("environ", "cmdline"))


def export_processes(marker: bytes) -> list[int]:
    """The running export processes whose environment holds ``marker`` (a ``NAME=value`` their host had: an export
    process starts with its host's environment less the ``OTEL_*`` variables)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if EXPORT_MODULE in open(f"/proc/{entry}/cmdline", "rb").read() and marker in proc_parts(int(entry)):
                    found.append(int(entry))
            except OSError:  # gone meanwhile
                continue
    return found
