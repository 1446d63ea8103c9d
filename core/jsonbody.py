"""Request bodies as JSON objects, no deeper than every parser and walker of the service handles.

json.loads and json.dumps recurse in C and the content walkers (core/content.py) in Python: a
body nested thousands of levels deep raises RecursionError in one of them, which is no error of
the tree and would answer 500. A body is refused with InvalidRequest (422) before any of them
sees it, when it is not JSON, not an object, or nested deeper than JSON_DEPTH_MAX.
"""

from __future__ import annotations

import json
from typing import Any

from core.errors import InvalidRequest

# Levels of arrays and objects in one request body. The deepest a real request goes is a tool's
# JSON Schema (OpenAI's structured outputs allow 10 levels of nesting, each two JSON levels,
# inside tools[i].function.parameters or response_format): far below this, and far below the
# depth at which a recursive walker runs out of stack.
JSON_DEPTH_MAX = 64


def loads_object(raw: bytes, what: str = "the body") -> dict[str, Any]:
    """`raw` parsed as a JSON object; InvalidRequest if it is not one, or is nested deeper than
    JSON_DEPTH_MAX."""
    try:
        doc = json.loads(raw)
    except RecursionError as exc:
        raise InvalidRequest(f"{what} is nested deeper than {JSON_DEPTH_MAX} levels") from exc
    except ValueError as exc:  # UnicodeDecodeError included
        raise InvalidRequest(f"{what} must be JSON") from exc
    if not isinstance(doc, dict):
        raise InvalidRequest(f"{what} must be a JSON object")
    if may_be_deep(raw) and depth(doc) > JSON_DEPTH_MAX:
        raise InvalidRequest(f"{what} is nested deeper than {JSON_DEPTH_MAX} levels")
    return doc


def may_be_deep(raw: bytes) -> bool:
    """False for a body that cannot be nested deeper than JSON_DEPTH_MAX: one with fewer
    brackets. Two counts in C decide it for most bodies; only larger ones need a walk."""
    return raw.count(b"[") + raw.count(b"{") > JSON_DEPTH_MAX


def check_depth(raw: bytes, what: str = "the body") -> None:
    """InvalidRequest if `raw`, a body a parser of its own will read, is JSON nested deeper than
    JSON_DEPTH_MAX (a body that is not JSON is left to that parser to refuse)."""
    if not may_be_deep(raw):
        return
    try:
        doc = json.loads(raw)
    except RecursionError as exc:
        raise InvalidRequest(f"{what} is nested deeper than {JSON_DEPTH_MAX} levels") from exc
    except ValueError:
        return
    if depth(doc) > JSON_DEPTH_MAX:
        raise InvalidRequest(f"{what} is nested deeper than {JSON_DEPTH_MAX} levels")


def depth(doc: object) -> int:
    """Levels of arrays and objects in `doc`, walked without recursion; it stops counting once
    past JSON_DEPTH_MAX."""
    deepest = 0
    stack: list[tuple[object, int]] = [(doc, 1)]
    while stack:
        node, level = stack.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(
            node, list) else None
        if children is None:
            continue
        deepest = max(deepest, level)
        if deepest > JSON_DEPTH_MAX:
            return deepest
        stack.extend((child, level + 1) for child in children
                     if isinstance(child, (dict, list)))
    return deepest


def loads_answer(raw: bytes | str) -> object:
    """A provider's answer (or one stream event) parsed, or None where it is not JSON or too deep
    to parse: the caller then treats the answer as one it cannot read."""
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):
        return None
