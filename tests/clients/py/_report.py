"""What every client script shares: run cases, one after another, and print one line per case
that the test reads (`CASE {json}`), whatever the case raised. The harness starts a script with
`--serve` and names each case on its stdin when it has set the provider up for it
(infra/py_clients.py); by hand, `python agents_sdk.py tools plain` runs the cases named.

These scripts run in the clients' own virtualenv (infra/py_clients.py), never the project's: they
import nothing from it. Each client is configured only as a team would point it at the gateway:
the base URL and the key, from the environment the test sets (OPENAI_BASE_URL, OPENAI_API_KEY,
ANTHROPIC_BASE_URL, ANTHROPIC_API_KEY). Telemetry is off before any client is imported.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import traceback
from collections.abc import Awaitable, Callable
from typing import Any

# Nothing may reach anything but the gateway on loopback: each library's telemetry is off.
os.environ.setdefault("OPENAI_AGENTS_DISABLE_TRACING", "1")
os.environ.setdefault("LANGSMITH_TRACING", "false")
os.environ.setdefault("LANGCHAIN_TRACING_V2", "false")
os.environ.setdefault("LOGFIRE_SEND_TO_LOGFIRE", "false")

# The protocol's two words; infra/py_clients.py reads them (CASE_MARKER, READY_LINE): these
# scripts import nothing of the project's, whose packages are not in their virtualenv.
MARKER = "CASE "
READY = "READY"

Case = Callable[[], Awaitable[str]]


def weather(city: str) -> str:
    """The tool every client is given: the model calls it, the client runs it and sends its
    result back in a second call (the multi-step turn)."""
    return f"It is 21 C and sunny in {city}."


PROMPT = "What is the weather in Paris? Use the weather tool, then answer in one sentence."


def _status(exc: BaseException) -> int | None:
    """The HTTP status behind an exception, however the library wrapped it."""
    seen: BaseException | None = exc
    while seen is not None:
        for attr in ("status_code", "status"):
            value = getattr(seen, attr, None)
            if isinstance(value, int):
                return value
        response = getattr(seen, "response", None)
        if response is not None and isinstance(getattr(response, "status_code", None), int):
            return int(response.status_code)
        seen = seen.__cause__ or seen.__context__
    return None


def _code(exc: BaseException) -> str | None:
    """The error code the gateway sent (`error.code` of its body), as the library kept it:
    the `code` of an `openai` error, or the parsed body of an `anthropic` or pydantic-ai one."""
    seen: BaseException | None = exc
    while seen is not None:
        code = getattr(seen, "code", None)
        if isinstance(code, str):
            return code
        body = getattr(seen, "body", None)
        if isinstance(body, dict):
            inner = body.get("error", body)
            if isinstance(inner, dict) and isinstance(inner.get("code"), str):
                return str(inner["code"])
        seen = seen.__cause__ or seen.__context__
    return None


async def _result(name: str, case: Case) -> dict[str, Any]:
    try:
        text = await case()
    # Whatever a client raises is the case's result: the test judges it.
    except Exception as exc:  # noqa: BLE001
        return {"case": name, "ok": False, "error_type": type(exc).__name__,
                "error_status": _status(exc), "error_code": _code(exc), "error": str(exc)[:2000],
                "traceback": traceback.format_exc()[-3000:]}
    return {"case": name, "ok": True, "text": text}


async def _run(cases: dict[str, Case], names: list[str]) -> None:
    for name in names:
        print(MARKER + json.dumps(await _result(name, cases[name])), flush=True)


async def _serve(cases: dict[str, Case]) -> None:
    """Run each case named on a line of stdin as it comes, until stdin closes: the harness sets
    the provider up for a case before it names it (infra/py_clients.py)."""
    loop = asyncio.get_running_loop()
    print(READY, flush=True)
    while line := await loop.run_in_executor(None, sys.stdin.readline):
        name = line.strip()
        result = (await _result(name, cases[name]) if name in cases
                  else {"case": name, "ok": False, "error_type": "UnknownCase", "error": name})
        print(MARKER + json.dumps(result), flush=True)


def main(cases: dict[str, Case]) -> None:
    """`--serve`: the cases named on stdin; else the cases named in argv (all, when none is).
    Either way in one event loop: a library's shared client (the Agents SDK's) is bound to the
    loop it was first used in."""
    args = sys.argv[1:]
    asyncio.run(_serve(cases) if args == ["--serve"] else _run(cases, args or list(cases)))
