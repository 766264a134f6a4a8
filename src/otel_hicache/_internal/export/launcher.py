"""The launcher of an export process, run by path as ``python -S launcher.py FDS`` (no ``site``: it starts in
milliseconds): fork, name the child on the liveness pipe (its standard error; the line
:data:`otel_hicache._internal.shared.plan.PID_LINE` starts), exit at once so the host reaps it; the orphaned child
becomes the export process (:mod:`otel_hicache._internal.export.boot`). So the export process is not the host's child:
an engine that stops its scheduler with ``kill_process_tree`` or SIGKILL does not take it along.

It imports nothing but ``os`` and ``sys``: without ``site`` it may not find anything else, and it must not read the
host's environment before the plan has set the export process's own.
"""

import os
import sys


def launch(fds: str) -> None:
    pid = os.fork()
    if pid:
        os.write(2, b"\x1fP%d\n" % pid)  # plan.PID_LINE
        os._exit(0)
    os.execv(sys.executable, [sys.executable, "-m", "otel_hicache._internal.export.boot", fds])


if __name__ == "__main__":
    launch(sys.argv[1])
