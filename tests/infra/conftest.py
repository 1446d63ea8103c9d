"""What the stub provider's test modules share: clients of the module's stub (its `provider`
fixture, which each module starts with its own seed and options), and the fresh start each test
is judged from.

`http` and `sdk` are the OpenAI side's (raw httpx, the `openai` SDK); a module on the Messages
API defines its own, with its key, its version header and the `anthropic` SDK.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from infra.stub_provider import StubProvider

# A stub call takes milliseconds; past this, the stub hangs.
CALL_TIMEOUT_S = 10.0


@pytest.fixture(scope="module")
def http(provider: StubProvider) -> Iterator[httpx.Client]:
    # One client: building an httpx client costs ~60 ms (its SSL context), a call a millisecond.
    with httpx.Client(base_url=provider.url, timeout=CALL_TIMEOUT_S) as client:
        yield client


@pytest.fixture(scope="module")
def sdk(provider: StubProvider) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{provider.url}/v1", api_key="sk-test", max_retries=0,
                         timeout=CALL_TIMEOUT_S)


def start_fresh(http: httpx.Client, control: dict[str, Any]) -> None:
    """The stub set as `control` says, and its bill emptied: a test is judged by its own calls,
    with nothing a test before it scripted left over."""
    http.post("/control", json=control).raise_for_status()
    http.post("/billing/reset").raise_for_status()
