"""What both processes build from the shared formats: runs in the export process, or in the host when it exports
in-process (the embedded default, providers handed to ``HiCacheTelemetry``).

Spans and metric instruments from the ring and the table (:mod:`.emitter`), the table's histograms handed to every
metric reader (:mod:`.histograms`), the tracer and meter providers (:mod:`.providers`), the exporters they are given,
each made by one call (:mod:`.exporters`), and their bounded shutdown (:mod:`.shutdown`). It imports the shared
formats, nothing of the host side or of the export process.
"""
