"""Output lengths by model, as a histogram shared through the ledger.

Reserving every call's full output cap locks a small budget after a handful of calls, though
most calls use a fraction of it. While a budget is far from its ceiling, the gateway reserves
the p95 output length seen for the model instead; settle charges the real cost either way, so
the ledger's invariant holds. Buckets grow by a quarter, so a p95 read from them is at most 25%
above the true one, and never below it. The stores keep the histograms (core/stores/keys.py
output_lengths is their key).
"""

from __future__ import annotations

import math

# Output lengths are bucketed from 16 tokens up to 2**20 (a million), each bucket 25% above the
# last: 50 buckets cover every real output length.
BUCKETS = tuple(sorted({math.ceil(16 * 1.25**i) for i in range(50)} | {2**20}))
BUCKET_TOKENS_MAX = 2**20
# Observations kept before every count is halved: recent calls weigh more than old ones.
OBSERVATIONS_MAX = 20_000
# Below this many observations a model's p95 is not trusted: the full cap is reserved.
OBSERVATIONS_MIN = 50
# A model's histogram is dropped after 30 days without a call: model names come from callers, so
# every name that was ever priced would otherwise be kept for ever, and lengths a month old say
# little about the next call.
HISTOGRAM_IDLE_MS = 30 * 24 * 3_600_000


def bucket(output_tokens: int) -> int:
    """The smallest bucket bound that holds `output_tokens`."""
    for bound in BUCKETS:
        if output_tokens <= bound:
            return bound
    return BUCKET_TOKENS_MAX


def p95(histogram: dict[int, int]) -> int | None:
    """The p95 bucket bound of a histogram; None with too few observations to trust."""
    total = sum(histogram.values())
    if total < OBSERVATIONS_MIN:
        return None
    seen = 0
    for bound in sorted(histogram):
        seen += histogram[bound]
        if seen * 100 >= total * 95:
            return bound
    return max(histogram)
