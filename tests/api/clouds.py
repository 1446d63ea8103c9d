"""What the suites that route Claude to the stub's clouds share (test_hostile_cloud.py,
tests/clients/test_js_cloud.py): the AWS key pair the stub's Bedrock verifies, the stub's Vertex
service account, and a gateway whose CEILING_UPSTREAMS names them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx

from infra.redis_server import RedisServer
from infra.service import ServiceProcess
from infra.stub_provider import StubProvider, stub_control
from tests.api.conftest import ADMIN_TOKEN

# AWS's documented example key pair (infra/stub_bedrock.py): nobody's.
ACCESS_KEY, SECRET_KEY, REGION = "AKIAIOSFODNN7EXAMPLE", "wJalrXUtnFEMIEXAMPLEKEY", "us-east-1"
BEDROCK_CREDENTIALS = {"access_key_id": ACCESS_KEY, "secret_access_key": SECRET_KEY,
                       "region": REGION}


def bedrock(stub: StubProvider, name: str, model_ids: dict[str, str]) -> dict[str, Any]:
    """A `bedrock` upstream at the stub, signing with the key pair above."""
    return {"name": name, "api": "bedrock", "region": REGION, "base_url": stub.url,
            "model_ids": model_ids}


def vertex(stub: StubProvider, directory: Path, name: str, region: str,
           models: list[str]) -> dict[str, Any]:
    """A `vertex` upstream at the stub, as the stub's service account (its JSON key written
    into `directory`)."""
    account_file = directory / "service-account.json"
    if not account_file.exists():
        account_file.write_text(httpx.get(f"{stub.url}/vertex/service_account").text)
    return {"name": name, "api": "vertex", "base_url": stub.url, "project": "stub-project",
            "region": region, "credentials_file": str(account_file), "models": models}


def cloud_gateway(redis_server: RedisServer, prices_file: str, directory: Path,
                  upstreams: list[dict[str, Any]], env: dict[str, str]) -> ServiceProcess:
    """A gateway instance (not started) whose CEILING_UPSTREAMS are `upstreams`, with the AWS
    key pair in its environment and `env` added."""
    path = directory / "upstreams.json"
    path.write_text(json.dumps({"upstreams": upstreams}))
    return ServiceProcess({
        "REDIS_URL": redis_server.url, "CEILING_ADMIN_TOKEN": ADMIN_TOKEN,
        "CEILING_PRICES_FILE": prices_file, "CEILING_UPSTREAMS": str(path),
        "AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY, **env,
    })


def trust_the_key_pair(stub: StubProvider) -> None:
    """The stub's Bedrock verifies signatures with the key pair above (its other settings and
    faults cleared)."""
    stub_control(stub.url, {"bedrock_credentials": BEDROCK_CREDENTIALS})
