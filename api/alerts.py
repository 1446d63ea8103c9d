"""Alert delivery's HTTP side: the sender core/alerts.py is given, one delivery pass,
and the background task of a long-running instance (`ceiling serve`).

A serverless deployment has no background: a scheduler calls POST /v1/admin/alerts/deliver
(vercel.json crons, serverless.yml schedule). Delivery never runs on a call's path.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Mapping
from typing import TYPE_CHECKING

from api.runtime import runtime
from core.alerts import ALERT_POST_TIMEOUT_S, DeliveryReport, Post, deliver_due
from core.errors import CeilingError

if TYPE_CHECKING:
    import httpx

log = logging.getLogger("spend_ceiling.alerts")


def _client() -> httpx.AsyncClient:
    # Imported when delivery first runs, not with the app: httpx (and what its CLI pulls in)
    # would add to every serverless instance's cold start, as the gateway's client would.
    import httpx

    return httpx.AsyncClient(timeout=ALERT_POST_TIMEOUT_S)


def http_post(client: httpx.AsyncClient) -> Post:
    async def post(url: str, body: bytes, headers: Mapping[str, str]) -> int:
        # No redirects: a signed event goes where it was configured to, nowhere else.
        answer = await client.post(url, content=body, headers=dict(headers),
                                   follow_redirects=False)
        return answer.status_code

    return post


async def deliver_once(client: httpx.AsyncClient | None = None) -> DeliveryReport | None:
    """One pass over every outbox; None when no webhook is configured (events stay in the
    outbox and the alert log)."""
    rt = runtime()
    store = rt.store()
    config = rt.config
    if config is None or not config.alert_webhook_url:
        return None
    own = client is None
    client = client or _client()
    try:
        return await deliver_due(store, config.alert_webhook_url,
                                 config.alert_webhook_secret or "", http_post(client))
    finally:
        if own:
            await client.aclose()


async def delivery_loop() -> None:
    """Delivery passes every CEILING_ALERT_DELIVERY_INTERVAL_S (5 s by default: an event goes
    out within seconds, and a pass that finds nothing costs a read per tag)."""
    config = runtime().config
    if config is None or not config.alert_webhook_url:
        # The configuration is read once per process: with no webhook there is nothing to
        # deliver to (events stay in the outbox and the alert log), and no client is made.
        return
    async with _client() as client:
        while True:
            try:
                await deliver_once(client)
            except CeilingError as exc:  # the ledger is down: the events wait in it
                log.warning("alert delivery skipped: %s", exc.message)
            except Exception:
                log.exception("alert delivery pass failed")
            await asyncio.sleep(config.alert_delivery_interval_s)


@contextlib.asynccontextmanager
async def delivering(_: object) -> AsyncIterator[None]:
    """The app's lifespan in `ceiling serve`: the delivery loop runs from the server's start-up
    to its shutdown. Serverless instances deliver from a schedule instead (the admin route)."""
    task = asyncio.create_task(delivery_loop())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
