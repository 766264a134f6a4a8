"""The host side: runs in the host process only (the engine's scheduler, or any producer of records).

Validation of a producer's records (:mod:`.validation`), counting them into the table and the ring (:mod:`.counting`),
the bounded queues an adapter's hot path fills (:mod:`.deferred`), the host thread (:mod:`.worker`), the consumers of
the ring (:mod:`.consumers`: in this process, or the export process through its handle) and every at-fork hook
(:mod:`.fork`). It may import the shared formats, what both build and the export process's handle.
"""
