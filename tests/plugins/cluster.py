"""The Redis Cluster store kind: RedisClusterStore on a real 3-master, 3-replica cluster.

Registering it here puts it in the conformance suite, the state machine and the cross-process
concurrency test; tests/core/stores/test_redis_cluster.py covers what only a cluster can get
wrong (placement, slots, failover).
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial

import pytest

from core.stores.redis_cluster import RedisClusterStore
from infra.redis_cluster import LocalCluster
from tests.support import CONTENTION_CALL_TIMEOUT_S, SHARED_STORE_BUILDERS, STORE_FACTORIES


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[LocalCluster]:
    """One cluster for the session; every node is stopped by pid at the end."""
    with LocalCluster() as cluster:
        yield cluster


def _cluster(request: pytest.FixtureRequest) -> LocalCluster:
    cluster = request.getfixturevalue("redis_cluster")
    assert isinstance(cluster, LocalCluster)
    return cluster


STORE_FACTORIES["cluster"] = lambda request, clock: RedisClusterStore(
    _cluster(request).url, clock=clock, call_timeout_s=CONTENTION_CALL_TIMEOUT_S
)
SHARED_STORE_BUILDERS["cluster"] = lambda request: partial(
    RedisClusterStore, _cluster(request).url, call_timeout_s=CONTENTION_CALL_TIMEOUT_S
)
