"""What a host hands its export process: the :class:`ExportPlan`, and the lines they exchange on the liveness pipe.

The plan is written once by the host (:class:`~otel_hicache._internal.export.handle.ExportProcess`) into a memfd and
read once by the exporter's boot (:mod:`otel_hicache._internal.export.boot`): :meth:`ExportPlan.to_json` and
:meth:`ExportPlan.from_json` are its one serialization. The standard library only: the exporter reads its plan, and
sets its environment from it, before anything imports the OTel API (which reads ``OTEL_PYTHON_CONTEXT`` on import).
"""

from __future__ import annotations

import dataclasses
import json
import os
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

#: How the liveness pipe's lines start: the launcher naming the exporter's pid, an exporter log record
#: (``LOG_LINE + b"<level> <text>"``).
PID_LINE, LOG_LINE = b"\x1fP", b"\x1fL"
#: The longest line relayed (a longer one is cut).
MAX_LINE_BYTES = 2000


@dataclass(frozen=True)
class ExportPlan:
    """Everything an export process needs to build the host's spans and metrics and export them as the host would.

    ``environment`` is the host's ``OTEL_*`` variables, the exporter's own environment (its settings are validated
    from it again, with ``endpoint``, ``protocol`` and ``cardinality_limit``: ``configure()``'s arguments, which win
    over the variables). ``resource``: the host's Resource attributes. ``spans``: build spans (an exporter is
    configured for them). ``pools``, ``seed_pools`` and ``capacity`` describe the channel it maps (its counter table
    and ring), filled in by :meth:`for_channel`; ``ids`` its id ring's arena in bytes (0: none), set at each launch.
    """

    environment: Mapping[str, str]
    resource: Mapping[str, Any]
    endpoint: str | None = None
    protocol: str | None = None
    cardinality_limit: int = 2000
    spans: bool = True
    token_metrics: bool = True
    pools: tuple[str, ...] = ()
    seed_pools: tuple[str, ...] = ()
    capacity: int = 0
    ids: int = 0

    def for_channel(self, pools: tuple[str, ...], seed_pools: tuple[str, ...], capacity: int) -> ExportPlan:
        """The plan for a channel of this layout."""
        return dataclasses.replace(self, pools=pools, seed_pools=seed_pools, capacity=capacity)

    def for_child(self) -> ExportPlan:
        """A forked child's plan: its own ``process.pid`` and ``service.instance.id``, the rest inherited."""
        resource = {**self.resource, "process.pid": os.getpid(), "service.instance.id": str(uuid.uuid4())}
        return dataclasses.replace(self, resource=resource)

    def to_json(self) -> bytes:
        fields = dataclasses.asdict(self)
        return json.dumps({**fields, "environment": dict(self.environment), "resource": dict(self.resource)}).encode()

    @classmethod
    def from_json(cls, data: bytes) -> ExportPlan:
        fields = json.loads(data)
        return cls(**{**fields, "pools": tuple(fields["pools"]), "seed_pools": tuple(fields["seed_pools"])})
