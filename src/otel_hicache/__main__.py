"""``otel-hicache`` (and ``python -m otel_hicache``): the demo command, :mod:`otel_hicache.cli`.

The command, the reference cache it runs and its progress bar need the ``demo`` extra (click, tqdm, torch, numpy):
without it the command says in one line what to install, and exits 2.
"""

from __future__ import annotations

import importlib.util
import sys

from otel_hicache.package import DEMO_MODULES, demo_missing


def main() -> None:
    try:
        for module in DEMO_MODULES:  # found, not imported: torch takes a second to import, and --help needs none
            if importlib.util.find_spec(module) is None:
                raise ModuleNotFoundError(name=module)
        from otel_hicache.cli import main as command
    except (ImportError, ValueError) as exc:  # ValueError: find_spec of a module whose import was blocked
        sys.stderr.write(f"otel-hicache: {demo_missing(getattr(exc, 'name', None) or str(exc))}\n")
        raise SystemExit(2) from None
    command()


if __name__ == "__main__":
    main()
