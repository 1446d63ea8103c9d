"""Faults and settings of the stub provider, as X-Stub-* headers and POST /control give them.

Parsing and checking, and the two ways a fault ends a call that both APIs share: a body broken
off mid-way and a call that hangs. What each fault does to a call is in infra.stub_provider
(and infra.stub_anthropic), whose module docstrings list them. A body or header that does not
parse is refused whole (400): a half-read fault would make a test pass for the wrong reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, fields
from typing import Any

from starlette.requests import Request

from infra.stub_input import FileRef

# The registries are bounded: a careless test must not grow the stub without end.
REGISTRY_ENTRIES_MAX = 10_000
# A hung call is held this long at most, so a forgotten client cannot keep the stub busy forever.
HANG_S_MAX = 600.0


@dataclass
class Fault:
    """What the next calls do besides (or instead of) answering; `calls_left` None: until
    cleared. At most one of the first five; the last three combine with any of them."""

    fail_status: int | None = None
    hang: bool = False
    fail_after_billing: int | None = None
    hang_after_billing: bool = False
    break_after_events: int | None = None
    continuous_usage: bool = False
    cached_tokens: int | None = None
    web_searches: int | None = None
    calls_left: int | None = None

    @property
    def name(self) -> str | None:
        """The fault that changes the answer, as logged in the bill."""
        for f in ("fail_status", "hang", "fail_after_billing", "hang_after_billing",
                  "break_after_events", "continuous_usage", "cached_tokens", "web_searches"):
            value = getattr(self, f)
            # `is`, not `in (None, False)`: 0 == False, and break_after_events=0 is a fault.
            if value is not None and value is not False:
                return f
        return None

    @property
    def active(self) -> bool:
        return self.name is not None and self.calls_left != 0

    def to_json(self) -> dict[str, Any]:
        doc = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "calls_left"}
        return {**doc, "calls": self.calls_left}


FAULT_HEADERS = {  # header -> Fault field
    "x-stub-fail-status": "fail_status",
    "x-stub-hang": "hang",
    "x-stub-fail-after-billing": "fail_after_billing",
    "x-stub-hang-after-billing": "hang_after_billing",
    "x-stub-break-after-events": "break_after_events",
    "x-stub-continuous-usage": "continuous_usage",
    "x-stub-cached-tokens": "cached_tokens",
    "x-stub-web-searches": "web_searches",
}
CONTROL_SETTINGS = frozenset({"images", "files", "prompt_cache", "default_service_tier",
                              "clock_offset_s", "web_search_result_tokens"})


def _status(raw: object, what: str) -> int:
    status = int(raw) if isinstance(raw, str) and raw.isdigit() else raw
    if type(status) is not int or not 400 <= status <= 599:
        raise ValueError(f"{what} must be an HTTP error status, 400 to 599")
    return status


def count(raw: object, what: str, minimum: int) -> int:
    value = int(raw) if isinstance(raw, str) and raw.isdigit() else raw
    if type(value) is not int or value < minimum:
        raise ValueError(f"{what} must be an integer of at least {minimum}")
    return value


def _flag(raw: object, what: str) -> bool:
    if raw in ("1", "true", True):
        return True
    if raw in ("0", "false", False):
        return False
    raise ValueError(f"{what} must be a boolean")


def fault_from(doc: Mapping[str, object]) -> Fault:
    """A Fault from /control's JSON or from X-Stub-* header values (strings)."""
    fault = Fault(
        fail_status=None if doc.get("fail_status") is None
        else _status(doc["fail_status"], "fail_status"),
        hang=_flag(doc.get("hang", False), "hang"),
        fail_after_billing=None if doc.get("fail_after_billing") is None
        else _status(doc["fail_after_billing"], "fail_after_billing"),
        hang_after_billing=_flag(doc.get("hang_after_billing", False), "hang_after_billing"),
        break_after_events=None if doc.get("break_after_events") is None
        else count(doc["break_after_events"], "break_after_events", 0),
        continuous_usage=_flag(doc.get("continuous_usage", False), "continuous_usage"),
        cached_tokens=None if doc.get("cached_tokens") is None
        else count(doc["cached_tokens"], "cached_tokens", 0),
        web_searches=None if doc.get("web_searches") is None
        else count(doc["web_searches"], "web_searches", 0),
        calls_left=None if doc.get("calls") is None else count(doc["calls"], "calls", 1),
    )
    exclusive = [fault.fail_status is not None, fault.hang, fault.fail_after_billing is not None,
                 fault.hang_after_billing, fault.break_after_events is not None]
    if sum(exclusive) > 1:
        raise ValueError("give one of fail_status, hang, fail_after_billing, "
                         "hang_after_billing and break_after_events")
    return fault


def registry_images(doc: object) -> dict[str, tuple[int, int]]:
    if not isinstance(doc, dict) or len(doc) > REGISTRY_ENTRIES_MAX:
        raise ValueError(f"images is an object of at most {REGISTRY_ENTRIES_MAX} URLs")
    return {str(url): _size(size, f"images[{url!r}]") for url, size in doc.items()}


def _size(raw: object, what: str) -> tuple[int, int]:
    if (not isinstance(raw, list) or len(raw) != 2
            or any(type(v) is not int or v < 1 for v in raw)):
        raise ValueError(f"{what} must be [width, height] in pixels")
    return raw[0], raw[1]


def registry_files(doc: object) -> dict[str, FileRef]:
    if not isinstance(doc, dict) or len(doc) > REGISTRY_ENTRIES_MAX:
        raise ValueError(f"files is an object of at most {REGISTRY_ENTRIES_MAX} entries")
    files = {}
    for key, entry in doc.items():
        if not isinstance(entry, dict) or set(entry) - {"bytes", "pages", "image"}:
            raise ValueError(f"files[{key!r}] is {{bytes, pages, image}}")
        image = entry.get("image")
        files[str(key)] = FileRef(
            count(entry.get("bytes"), f"files[{key!r}].bytes", 0),
            count(entry.get("pages", 0), f"files[{key!r}].pages", 0),
            None if image is None else _size(image, f"files[{key!r}].image"),
        )
    return files


# -- how a fault ends a call -------------------------------------------------------------------


class StreamBroken(Exception):
    """Raised inside a response body on purpose: uvicorn then drops the connection mid-body."""


class _QuietBreaks(logging.Filter):
    """Keep uvicorn from logging a deliberate break as an application error."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], StreamBroken))


logging.getLogger("uvicorn.error").addFilter(_QuietBreaks())


async def sent(events: list[bytes], *, broken: bool) -> AsyncIterator[bytes]:
    """A response body of `events`; `broken`: the connection is dropped after the last one."""
    for event in events:
        yield event
    if broken:
        raise StreamBroken("the stub broke this answer off on purpose")


async def hang(request: Request) -> None:
    """Answer nothing until the client goes away (or HANG_S_MAX passes)."""
    # Reading ASGI messages drains the body, then blocks until the client disconnects.
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(HANG_S_MAX):
            while (await request.receive())["type"] != "http.disconnect":
                pass
