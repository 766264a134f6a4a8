"""The export process: its handle in the host (:mod:`.handle`: launch, tend, reap), the launcher and boot that start
it (:mod:`.launcher`, :mod:`.boot`), and its main loop (:mod:`.main`).

The handle runs in the host; the rest runs in the export process. It imports the shared formats and what both build,
nothing of the host side (``tests/test_import_graph.py``): a lifecycle change stays inside this folder and the plan.
"""
