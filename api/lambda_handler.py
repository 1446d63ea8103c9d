"""AWS Lambda's entry point: the same app behind mangum.

Lifespan is off: mangum would run start-up and shutdown on every invocation. Nothing needs
them: the runtime (config, Redis pool) is made on the first request and kept while the
instance is warm.
"""

from mangum import Mangum

from api.index import app

handler = Mangum(app, lifespan="off")
