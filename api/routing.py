"""LeanRoute: a route FastAPI documents but that runs as Starlette runs one.

The hot routes (reserve, settle, the gateway) read their own headers and body, and take the
Request and return a Response. FastAPI's request handler (dependency solving, per-request exit
stacks) cost more CPU per call than the ledger round trip (bench/http.py, bench/gateway.py);
with this class the endpoint is called with nothing in between, and the app's exception handlers
still map every error.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute
from starlette.routing import request_response

Endpoint = Callable[[Request], Awaitable[Response]]


class LeanRoute(APIRoute):
    def __init__(self, path: str, endpoint: Endpoint, **kwargs: Any) -> None:
        super().__init__(path, endpoint, **kwargs)
        self.handler = self.wrap(endpoint)
        self.app = request_response(self.handler)

    def wrap(self, endpoint: Endpoint) -> Endpoint:
        """What runs for a request; a subclass adds its own handling around the endpoint."""
        return endpoint
