"""Which SGLang rank reports the instruments counted in tokens (no SGLang needed)."""

from __future__ import annotations

import pytest

from otel_hicache.integrations.sglang.instrumentor import reports_tokens


@pytest.mark.parametrize(
    ("ranks", "reports"),
    [
        ({}, True),  # nothing published: a single-process server
        ({"tp": 0, "attn_tp": 0, "pp": 0}, True),
        ({"tp": 1, "attn_tp": 1, "pp": 0}, False),  # another rank of the TP group
        ({"tp": 0, "attn_tp": 0, "pp": 1}, False),  # a later pipeline stage: the same tokens again
        ({"tp": 3, "attn_tp": 0, "pp": 0, "dp": 1}, True),  # attention DP: rank 0 of its own attention-TP group
        ({"tp": 1, "pp": 0}, False),  # attention-TP unknown: the TP rank decides
        ({"tp": 2, "attn_tp": 0, "attn_cp": 1, "pp": 0}, False),  # context parallel: another CP rank, same tokens
        ({"tp": 0, "attn_tp": 0, "attn_cp": 0, "pp": 0}, True),
    ],
)
def test_one_rank_per_attention_tp_cp_and_pp_group_reports_tokens(ranks: dict[str, int], reports: bool) -> None:
    assert reports_tokens(ranks) is reports
