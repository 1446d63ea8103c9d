"""The pieces every format's request body schema (WireFormat.body_schema) is built of: JSON
Schema for the OpenAPI document.

Documentation only: the gateway reads the raw body (core/gateway.py `plan`) and forwards it as
priced, so nothing validates a request against these. A body schema names what its format reads
to bound a call's cost: the model, the prompt and the content it can bound (text, images,
audio), the output caps, `n`, streaming, the tools it lets through and the service tier. Fields
a format forwards without reading (temperature, stop, seed...) are allowed by its object
without being named, except where the gateway refuses what it does not know (an image's or an
audio part's fields, the Messages body's top level). What the gateway refuses (hosted tools,
files, stored items) is not documented as accepted.

Written as JSON Schema, not as models: nothing is validated with them, and a literal costs a
serverless cold start nothing to import.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from core.limits import TOKENS_MAX

# A JSON Schema, as the OpenAPI document takes it.
Schema = dict[str, Any]


def object_of(properties: Schema, required: Sequence[str] = (), *, more: bool = True) -> Schema:
    """An object of these properties; `more`: other fields are allowed (and forwarded)."""
    return {"type": "object", "properties": properties, "required": list(required),
            "additionalProperties": more}


def const(value: str) -> Schema:
    return {"type": "string", "const": value}


def array(items: Schema, min_items: int = 0) -> Schema:
    return {"type": "array", "items": items, "minItems": min_items}


def any_of(*schemas: Schema) -> Schema:
    return {"anyOf": list(schemas)}


STRING: Schema = {"type": "string"}
BOOLEAN: Schema = {"type": "boolean"}
TOKENS: Schema = {"type": "integer", "minimum": 1, "maximum": TOKENS_MAX}
MODEL: Schema = {"type": "string", "minLength": 1}
IMAGE_URL: Schema = {"type": "string", "minLength": 1,
                     "description": "an http(s) URL or a data URL of an image"}
JSON_SCHEMA: Schema = {"type": "object", "description": "a JSON Schema"}
