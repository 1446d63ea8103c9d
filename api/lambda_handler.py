"""AWS Lambda's entry point: the same app behind mangum.

Lifespan is off: mangum would run start-up and shutdown on every invocation. Nothing needs
them: the runtime (config, Redis pool) is made on the first request and kept while the
instance is warm.
"""

from mangum import Mangum

from api.index import app

handler = Mangum(app, lifespan="off")


def deliver_alerts(event: object, context: object) -> dict[str, object]:
    """The scheduled function of serverless.yml: one alert delivery pass (issue 16)."""
    import asyncio

    from api.alerts import deliver_once

    report = asyncio.run(deliver_once())
    return {"webhook_configured": report is not None, **(report.json() if report else {})}
