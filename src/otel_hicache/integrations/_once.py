"""One warning per problem per process family, and the failure rule's log line.

An engine runs one process per rank: the first process of the family (its process group) to meet a problem warns
about it; its siblings log it at debug level. Used by the patching, the sink and every adapter's hooks.
"""

from __future__ import annotations

import hashlib
import logging
import os
import stat
import tempfile
import threading
from pathlib import Path
from typing import Any, Final

_log = logging.getLogger(__name__)


class _Once:
    """Which problems were warned about, in this process and in its process family.

    The family is the process group (an engine's launcher and the rank processes it spawns share it); its first
    process to warn about a problem leaves a marker file that its siblings see. Where no marker can be made (no
    ``/proc``, an unsafe directory) each process warns once.
    """

    def __init__(self) -> None:
        self.seen: set[str] = set()
        self.directory: Path = Path(tempfile.gettempdir()) / f"otel-hicache-{os.getuid()}"
        self._lock = threading.Lock()

    def first(self, key: str) -> bool:
        """Whether this is the first time ``key`` comes up in this process and in its family."""
        with self._lock:
            if key in self.seen:
                return False
            self.seen.add(key)
        try:
            return self._first_in_family(key)
        except Exception:  # no family marker here: once per process
            return True

    def _first_in_family(self, key: str) -> bool:
        family = _family()
        if family is None:
            return True
        directory = self.directory
        directory.mkdir(mode=0o700, exist_ok=True)
        info = os.lstat(directory)
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
            return True  # not ours alone: a marker there proves nothing
        digest = hashlib.sha256(f"{family[0]}\0{key}".encode()).hexdigest()[:24]
        try:
            os.close(os.open(directory / f"{family[1]}-{digest}", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        except FileExistsError:
            return False
        _forget_dead_families(directory)
        return True


def _family() -> tuple[str, str] | None:
    """(this process family's identity, its process group's marker prefix), or None where it cannot be told."""
    pgid = os.getpgrp()
    start = _start_time(pgid)
    if start is None:
        return None
    boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    return f"{boot}:{pgid}:{start}", f"{pgid}.{start}"


def _start_time(pid: int) -> str | None:
    """When process ``pid`` started (clock ticks since boot), or None if it is not running."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _forget_dead_families(directory: Path) -> None:
    """Remove the markers of process groups that are gone (a later group may reuse their id)."""
    for marker in directory.iterdir():
        pgid, _, rest = marker.name.partition(".")
        start = rest.partition("-")[0]
        if pgid.isdigit() and _start_time(int(pgid)) != start:
            marker.unlink(missing_ok=True)


ONCE: Final = _Once()


def warn_once(key: str, message: str, *args: Any, exc_info: bool = False) -> None:
    """Log ``message`` as a warning the first time ``key`` comes up in this process family; at debug level after."""
    _log.log(logging.WARNING if ONCE.first(key) else logging.DEBUG, message, *args, exc_info=exc_info)


def inform_once(key: str, message: str, *args: Any) -> None:
    """Log ``message`` at info level the first time ``key`` comes up in this process family (something left out on
    purpose, not a problem: an untested release, a tier the capacity model does not describe); at debug level after."""
    _log.log(logging.INFO if ONCE.first(key) else logging.DEBUG, message, *args)


def hook_failed(engine: str, hook: str) -> None:
    """The failure rule: our code around ``engine``'s ``hook`` raised (call from its ``except`` block)."""
    warn_once(
        f"failed:{engine}:{hook}",
        "otel_hicache: our %s hook %s failed; %s runs unchanged, this hook's telemetry may be incomplete. Further "
        "failures of this hook are not logged.",
        engine,
        hook,
        engine,
        exc_info=True,
    )
