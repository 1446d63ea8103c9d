"""Claude's Messages API as the clouds serve it (Bedrock, Vertex): the body they take, and their
errors given Anthropic's shape, so that the anthropic SDK raises them as it would Anthropic's."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import replace

from core.formats import Plan
from core.upstream import Sent

# Anthropic's error types by status, for a cloud's error turned into Anthropic's shape: the
# anthropic SDK picks its exception class by status and shows `error.type` and `message`.
ANTHROPIC_ERROR_TYPES: Mapping[int, str] = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
    500: "api_error", 503: "overloaded_error", 504: "timeout_error", 529: "overloaded_error",
}
# The content type of an Anthropic Messages stream, as Anthropic sends it.
SSE_CONTENT_TYPE = "text/event-stream; charset=utf-8"


def cloud_messages_body(call_plan: Plan, anthropic_version: str, *,
                        betas_in_body: bool) -> tuple[str, bytes]:
    """(the model, the body) of a Messages call as a cloud takes it: the model goes in the path,
    so the body has no `model` (nor `stream`: the path says that too), and names the cloud's
    API version. `betas_in_body`: the `anthropic-beta` header's betas go in the body's
    `anthropic_beta` list (Bedrock reads no header)."""
    body = dict(call_plan.body)
    model = str(body.pop("model", call_plan.model))
    body.pop("stream", None)
    body["anthropic_version"] = anthropic_version
    if betas_in_body:
        betas = [beta.strip() for name, value in call_plan.headers
                 if name.lower() == "anthropic-beta" for beta in value.split(",")
                 if beta.strip()]
        if betas:
            body["anthropic_beta"] = list(dict.fromkeys([*body.get("anthropic_beta", ()),
                                                         *betas]))
    return model, replace(call_plan, body=body).content()


def anthropic_error(status: int, message: str) -> bytes:
    """An error body in Anthropic's shape, for a cloud's error in its own."""
    return json.dumps({"type": "error", "error": {
        "type": ANTHROPIC_ERROR_TYPES.get(status, "api_error" if status >= 500
                                          else "invalid_request_error"),
        "message": message}}).encode()


def error_message(doc: object) -> str | None:
    """The message of a cloud's error body, parsed: AWS's {"message"} ({"Message"} on some),
    Google's {"error": {"message"}}; None for one of neither shape."""
    if not isinstance(doc, dict):
        return None
    inner = doc.get("error")
    if isinstance(inner, dict) and isinstance(inner.get("message"), str):
        return str(inner["message"])
    for key in ("message", "Message"):
        if isinstance(doc.get(key), str):
            return str(doc[key])
    return None


def error_as_anthropic(sent: Sent) -> Sent:
    """An error's Sent with its body in Anthropic's shape (unless it is already), so that the
    anthropic SDK raises it as it would Anthropic's own."""
    assert isinstance(sent[2], bytes)
    try:
        doc = json.loads(sent[2])
    except ValueError:
        doc = None
    if isinstance(doc, dict) and doc.get("type") == "error":
        return sent
    message = (error_message(doc) or sent[2].decode(errors="replace").strip()
               or f"the provider answered {sent[0]}")
    headers = {**sent[1], "content-type": "application/json"}
    return (sent[0], headers, anthropic_error(sent[0], message))
