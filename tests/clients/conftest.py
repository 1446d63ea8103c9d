"""What both client modules share: the stub provider behind their gateway, and an admin client
of that gateway. Each module starts its own gateway (`gw`), with its own prices and timeout."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from infra.stub_provider import StubProvider

# The admin client of the module's `gw`, as tests/api's modules have it: found here by name.
from tests.api.conftest import admin  # noqa: F401


@pytest.fixture(scope="module")
def stub() -> Iterator[StubProvider]:
    with StubProvider(seed=34, latency_ms_min=0, latency_ms_max=2) as provider:
        yield provider
