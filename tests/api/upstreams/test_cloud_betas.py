"""The betas the gateway sends each cloud (api/upstreams/cloud_messages.py) against those the
cloud takes, as its stub keeps them from the cloud's own pages (infra/stub_bedrock.py BETAS,
infra/stub_vertex.py BETAS): a beta the gateway sends that the cloud does not take would fail
every call that names it (Claude Code names several on every call)."""

from __future__ import annotations

import pytest

from api.upstreams.cloud_messages import BEDROCK_BETAS, VERTEX_BETAS
from infra import stub_bedrock, stub_vertex

CLOUDS = {"bedrock": (BEDROCK_BETAS, stub_bedrock.BETAS),
          "vertex": (VERTEX_BETAS, stub_vertex.BETAS)}


@pytest.mark.parametrize("cloud", CLOUDS)
def test_every_beta_the_gateway_sends_a_cloud_is_one_it_takes(cloud: str) -> None:
    sent, taken = CLOUDS[cloud]
    assert sent - taken == set(), f"{cloud} does not take these betas the gateway sends it"

