"""Ground truth for the demo's capacity curve: the demo run at today's sizes, then again with one tier at each size.

Today's run gives the prediction (``hicache.capacity.hit_ratio``, the demo's ``capacity``); each re-run changes one
tier's capacity in tokens, everything else as today (the seed, hence the same prompts, the pools, the L3 store), and
measures the share of prompt tokens that tier or a faster one served (the cache's own bookkeeping,
:attr:`~otel_hicache.cache.demo.DemoResult.served_shares`). Used by ``tests/cache/test_capacity.py`` and
``python -m benchmarks capacity_reruns``::

    >>> check = rerun_demo(7, "write_back", requests=40, sizes={"device": ("2",)})
    >>> sorted(check.errors())
    [('device', '1'), ('device', '2'), ('host', '1')]
"""

from __future__ import annotations

import tempfile
from collections.abc import Mapping
from dataclasses import dataclass

from otel_hicache.cache.demo import DEMO_POOLS, DEVICE_TOKENS, HOST_TOKENS, run_demo
from otel_hicache.cache.pools import PoolSpec
from otel_hicache.testing.sdk import make_sdk

#: The factors re-run per tier by default (1x is today's run itself).
SIZES: Mapping[str, tuple[str, ...]] = {"device": ("0.5", "2"), "host": ("0.5", "2", "4")}
TODAY = {"device": DEVICE_TOKENS, "host": HOST_TOKENS}


@dataclass(frozen=True)
class Rerun:
    """One seed and policy: tier -> factor -> the predicted share (from today's run) and the share observed at that
    size (factor ``1``: today's run)."""

    predicted: dict[str, dict[str, float]]
    observed: dict[str, dict[str, float]]

    def errors(self) -> dict[tuple[str, str], float]:
        """(tier, factor) -> predicted minus observed, for every size observed."""
        return {
            (tier, factor): self.predicted[tier][factor] - share
            for tier, by_factor in self.observed.items()
            for factor, share in by_factor.items()
        }


def rerun_demo(
    seed: int,
    policy: str,
    *,
    requests: int,
    pools: tuple[PoolSpec, ...] = DEMO_POOLS,
    l3: bool = True,
    sizes: Mapping[str, tuple[str, ...]] = SIZES,
) -> Rerun:
    """The demo at ``seed`` under ``policy`` (``requests`` prompts, on the CPU) today and at each of ``sizes``."""

    def serve(device_tokens: int, host_tokens: int) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
        sdk = make_sdk(spans=False)
        try:
            with tempfile.TemporaryDirectory(prefix="otel-hicache-rerun-") as store:
                result = run_demo(
                    sdk.telemetry,
                    requests=requests,
                    seed=seed,
                    device="cpu",
                    write_policy=policy,
                    storage_dir=store,
                    device_tokens=device_tokens,
                    host_tokens=host_tokens,
                    pools=pools,
                    l3=l3,
                )
        finally:
            sdk.shutdown()
        return result.served_shares, {tier: dict(c["hit_ratio"]) for tier, c in result.capacity.items()}

    shares, predicted = serve(TODAY["device"], TODAY["host"])
    observed = {tier: {"1": shares[tier]} for tier in predicted}
    for tier, factors in sizes.items():
        for factor in factors:
            sized = dict(TODAY, **{tier: int(float(factor) * TODAY[tier])})
            observed[tier][factor] = serve(sized["device"], sized["host"])[0][tier]
    return Rerun(predicted, observed)
