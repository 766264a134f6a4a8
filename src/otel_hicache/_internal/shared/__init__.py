"""The formats both processes share, and nothing else: runs in the host and in the export process alike.

The table (:mod:`.accumulation`: every counter series, pool gauge and histogram series), the memory that holds it
with the transfer ring (:mod:`.channel`), and the plan a host hands its export process with the lines of their pipe
(:mod:`.plan`). It imports nothing of the host side or of the export process (``tests/test_import_graph.py``).
"""
