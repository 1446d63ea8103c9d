from core.output_stats import BUCKETS, OBSERVATIONS_MIN, bucket, p95
from core.stores.keys import output_lengths


def test_buckets_bound_from_above_within_a_quarter() -> None:
    for tokens in (1, 16, 17, 500, 4_096, 100_000, 2**20):
        b = bucket(tokens)
        assert tokens <= b <= max(16, tokens * 1.25 + 1)
    assert bucket(10**9) == 2**20
    assert list(BUCKETS) == sorted(BUCKETS)


def test_p95_needs_enough_observations() -> None:
    assert p95({16: OBSERVATIONS_MIN - 1}) is None
    assert p95({16: 95, 1_000: 5}) == 16
    assert p95({16: 94, 1_000: 6}) == 1_000


def test_model_keys_are_digests() -> None:
    assert output_lengths("GPT-4o") == output_lengths("gpt-4o")
    key = output_lengths("a{b}/c d")
    assert key.startswith("sc:{out:")
    assert key.count("{") == 1
