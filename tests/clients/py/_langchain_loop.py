"""The tool loop both LangChain clients run (langchain_openai_client.py,
langchain_anthropic_client.py), written as LangChain's docs show it: invoke (or stream), run the
tool the model called, send its result back, until the model answers in text.

Like _report.py, it runs in the clients' own virtualenv and imports nothing of the project's.
"""

from __future__ import annotations

from _report import PROMPT, weather
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import BaseMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool

weather_tool = tool(weather)
# A tool turn is two calls (the call, then the answer); past this, the model is looping.
STEPS_MAX = 4


def tool_loop(llm: BaseChatModel, stream: bool) -> str:
    """The model's text answer to PROMPT, with the weather tool run for each call it makes."""
    bound = llm.bind_tools([weather_tool])
    messages: list[BaseMessage] = [HumanMessage(PROMPT)]
    for _ in range(STEPS_MAX):
        if stream:
            reply = None
            for chunk in bound.stream(messages):
                reply = chunk if reply is None else reply + chunk
            assert reply is not None
        else:
            reply = bound.invoke(messages)
        messages.append(reply)
        calls = getattr(reply, "tool_calls", [])
        if not calls:
            return str(reply.text)
        for call in calls:
            messages.append(ToolMessage(weather_tool.invoke(call["args"]),
                                        tool_call_id=call["id"]))
    raise RuntimeError(f"no answer after {STEPS_MAX} steps")
