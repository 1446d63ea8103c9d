"""LeanRoute: a route FastAPI documents but that runs as Starlette runs one.

The hot routes (reserve, settle, the gateway) read their own headers and body, and take the
Request and return a Response. FastAPI's request handler (dependency solving, per-request exit
stacks) cost more CPU per call than the ledger round trip (bench/http.py, bench/gateway.py).
CeilingApp (api/app.py) runs a lean route's `handler` ahead of FastAPI's middleware; the route's
own `app` runs the same handler, so a router that reaches the route itself (these routers in an
app other than CeilingApp) answers the same way, the app's exception handlers mapping its errors.
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
