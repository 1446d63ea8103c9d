"""GET /metrics: the shared ledger in Prometheus' text format, for a monitor to scrape.

Behind `Authorization: Bearer <CEILING_METRICS_TOKEN>` (or the admin token): budget ids name
customers. Closed (403) when neither token is set, as the admin routes are; any other caller
is 401.

Each scrape reads the ledger (core/metrics.py) and renders it with prometheus_client into a
registry of its own, made for that scrape: nothing is registered in the library's global
registry, and one scrape's figures never linger into the next. The one figure this instance
keeps across scrapes is the latency of its ledger calls, a histogram observed by every scrape's
calls; a ledger that does not answer is `spend_ceiling_ledger_up 0`, with a 200, as Prometheus
expects of an exporter whose target is down.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, cast

from starlette.requests import Request
from starlette.responses import Response

from api.auth import bearer
from api.routes.health import DOWN_REASONS
from api.routing import HotRoute
from api.runtime import admin_token, is_admin_token, runtime
from core.errors import CeilingError, Forbidden, Unauthorized
from core.metrics import LedgerReading, read_ledger, settings_from_env

if TYPE_CHECKING:
    from prometheus_client import Histogram, Metric
    from prometheus_client.registry import Collector

# Bucket bounds of the ledger latency histogram, seconds: a Redis round trip on a LAN is a
# fraction of a millisecond, Upstash's REST over the internet tens of milliseconds, and past a
# second a call is near its time bound.
LEDGER_LATENCY_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                            1.0, 2.5, 5.0)
_latency: Histogram | None = None


def ledger_latency() -> Histogram:
    """This instance's histogram of ledger call latency, made on the first scrape (the import
    of prometheus_client is paid by a scrape, not by the admin surface), in no registry."""
    global _latency
    if _latency is None:
        from prometheus_client import Histogram

        _latency = Histogram("spend_ceiling_ledger_latency_seconds",
                             "Latency of this instance's ledger calls, seconds",
                             buckets=LEDGER_LATENCY_BUCKETS_S, registry=None)
    return _latency


def scraper(authorization: str | None) -> None:
    """The metrics token or the admin token, compared in constant time; 401 for anything else."""
    import hmac

    token = settings_from_env(os.environ).token
    if not token and not admin_token():
        raise Forbidden("metrics are closed: set CEILING_METRICS_TOKEN (or CEILING_ADMIN_TOKEN)")
    given = bearer(authorization) or ""
    if token and hmac.compare_digest(given.encode(), token.encode()):
        return
    if not is_admin_token(given):
        raise Unauthorized("the metrics token (or the admin token) is required")


class Reading:
    """A prometheus_client collector of one reading of the ledger (a collector is anything with
    collect(); not a subclass of the library's, whose import waits for the first scrape)."""

    def __init__(self, reading: LedgerReading | None) -> None:
        self.reading = reading

    def collect(self) -> Iterator[Metric]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        reading = self.reading
        up = reading is not None and reading.error is None and reading.probe.reachable and \
            not DOWN_REASONS.intersection(reading.probe.reasons)
        yield GaugeMetricFamily("spend_ceiling_ledger_up",
                                "1 when the shared ledger answers and can enforce, else 0",
                                value=1 if up else 0)
        families = {
            name: GaugeMetricFamily(f"spend_ceiling_budget_{name}_micros", doc,
                                    labels=("budget_id", "period"))
            for name, doc in (
                ("ceiling", "A budget's ceiling in its current period window, micro-dollars"),
                ("committed", "Committed spend in a budget's current period window, "
                              "micro-dollars"),
                ("reserved", "Held by open reservations in a budget's current period window, "
                             "micro-dollars"),
            )}
        # A budget's calls of one model of its per_model limits: families of their own, so the
        # budget families keep one label set. At most PER_MODEL_MAX models of the budgets shown.
        model_families = {
            name: GaugeMetricFamily(f"spend_ceiling_budget_model_{name}_micros", doc,
                                    labels=("budget_id", "model", "period"))
            for name, doc in (
                ("ceiling", "A budget's per_model ceiling of one model in its current period "
                            "window, micro-dollars"),
                ("committed", "Committed spend of a budget's calls of one model in its current "
                              "period window (also in the budget's), micro-dollars"),
                ("reserved", "Held by open reservations of a budget's calls of one model in its "
                             "current period window, micro-dollars"),
            )}
        refusals = CounterMetricFamily("spend_ceiling_refusals",
                                       "Refusals the ledger decided, by error code",
                                       labels=("code",))
        if reading is not None:
            for b in reading.budgets:
                shown, labels = ((families, (b.budget_id, b.period)) if b.model is None else
                                 (model_families, (b.budget_id, b.model, b.period)))
                shown["ceiling"].add_metric(labels, b.ceiling_micros)
                shown["committed"].add_metric(labels, b.committed_micros)
                shown["reserved"].add_metric(labels, b.reserved_micros)
            for code, count in sorted(reading.refusals.items()):
                refusals.add_metric((code,), count)
        yield from families.values()
        yield from model_families.values()
        yield refusals
        for histogram in ledger_latency().collect():
            # Its creation time is the process's start: not a figure anyone scrapes for, and in
            # the text format a family of its own.
            histogram.samples = [s for s in histogram.samples if not s.name.endswith("_created")]
            yield histogram


async def metrics(request: Request) -> Response:
    from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

    scraper(request.headers.get("authorization"))
    settings = settings_from_env(os.environ)
    rt = runtime()
    reading = None
    try:
        backend = rt.backend
        reading = await read_ledger(rt.store(), backend.catalogue if backend else None,
                                    rt.instance_id, settings.budgets_max)
    except CeilingError:  # no ledger configured: the scrape says it is down
        reading = None
    if reading is not None:
        latency = ledger_latency()
        for seconds in reading.call_latencies_s:
            latency.observe(seconds)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(cast("Collector", Reading(reading)))
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


# A hot route (api/routing.py), as health is: a monitor's scrape does not build the admin
# surface. Authorization here is the metrics token or the admin token.
ROUTES = (HotRoute("/metrics", metrics, methods=("GET",), keyed=False, headers=("Authorization",)),)
