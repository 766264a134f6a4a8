"""The export process's first lines, run as ``python -m otel_hicache._internal.export.boot FDS`` by the launcher.

``FDS``: the hang-up pipe's read end, the channel's memfd, the plan's memfd, the liveness pipe's write end (its
standard error). The plan sets the process's environment - the host's ``OTEL_*`` variables - before anything reads
it (the OTel API reads ``OTEL_PYTHON_CONTEXT`` on import), so only then is the main loop imported.
"""

from __future__ import annotations

import os
import sys


def boot(fds: list[int]) -> None:
    from otel_hicache._internal.shared.plan import ExportPlan

    with os.fdopen(fds[2], "rb") as f:
        plan = ExportPlan.from_json(f.read())
    os.environ.update(plan.environment)
    from otel_hicache._internal.export.main import main

    main(fds[0], fds[1], plan)


if __name__ == "__main__":
    boot([int(fd) for fd in sys.argv[1].split(",")])
