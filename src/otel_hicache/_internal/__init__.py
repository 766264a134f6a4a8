"""The pipeline's mechanism, behind the public API: nothing here is a user's to import.

Users call :mod:`otel_hicache` (``configure()``, :class:`~otel_hicache.telemetry.HiCacheTelemetry`, the records);
only the facade modules :mod:`otel_hicache.telemetry` and :mod:`otel_hicache.sdk` import these modules
(``tests/test_import_graph.py`` keeps it so).
"""
