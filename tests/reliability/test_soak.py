"""A steady rate through a fleet for 30 s: no instance's memory grows, nothing piles up.

The CI cut of the soak (infra/soak.py; `python -m bench.soak` runs it for 10 minutes): three
10 s buckets, the first one warm-up. Judged on what drifts (memory, open reservations, the
books), not on latency, which a shared 2-core machine makes too noisy to assert in 30 s; the
p99s are printed.
"""

from __future__ import annotations

import pytest

from infra.soak import RSS_GROWTH_MAX, SoakConfig, SoakResult, report, run

pytestmark = pytest.mark.slow

CONFIG = SoakConfig(duration_s=30, rate_per_s=40, instances=4, bucket_s=10, sample_s=2)


@pytest.fixture(scope="module")
def soaked() -> SoakResult:
    result = run(CONFIG)
    print("\n" + report(result))
    return result


def test_every_call_was_served(soaked: SoakResult) -> None:
    expected = int(CONFIG.duration_s * CONFIG.rate_per_s)
    assert (soaked.calls, soaked.skipped) == (expected, 0), report(soaked)
    assert soaked.errors == 0, soaked.error_kinds


def test_no_instance_memory_grows(soaked: SoakResult) -> None:
    assert len(soaked.rss_growth) == CONFIG.instances
    assert max(soaked.rss_growth) <= RSS_GROWTH_MAX, report(soaked)
    assert soaked.memory_flat


def test_open_reservations_stay_bounded_and_none_is_left(soaked: SoakResult) -> None:
    # Every open reservation is a call in flight: bounded by the load, not by time.
    assert soaked.open_max <= CONFIG.in_flight_max
    assert soaked.open_at_end == 0
    assert soaked.open_bounded


def test_the_books_equal_the_bill(soaked: SoakResult) -> None:
    assert soaked.committed_micros == soaked.billed_micros > 0
    assert soaked.billed_calls == soaked.calls
