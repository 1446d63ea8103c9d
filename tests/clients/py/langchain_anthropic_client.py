"""langchain-anthropic: ChatAnthropic with a tool, the tool loop as LangChain's docs show it."""

from __future__ import annotations

from _report import PROMPT, main, weather
from langchain_anthropic import ChatAnthropic
from langchain_core.messages import BaseMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool

MODEL = "claude-sonnet-4-5"
weather_tool = tool(weather)


def _loop(llm: ChatAnthropic, stream: bool) -> str:
    bound = llm.bind_tools([weather_tool])
    messages: list[BaseMessage] = [HumanMessage(PROMPT)]
    for _ in range(4):
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
    raise RuntimeError("no answer after 4 steps")


async def tools() -> str:
    return _loop(ChatAnthropic(model=MODEL), stream=False)


async def tools_stream() -> str:
    return _loop(ChatAnthropic(model=MODEL), stream=True)


async def tools_thinking() -> str:
    """Extended thinking on: the thinking blocks (with their signatures) go back in step 2."""
    return _loop(ChatAnthropic(model=MODEL, max_tokens=4096,
                               thinking={"type": "enabled", "budget_tokens": 2048}), stream=False)


async def plain() -> str:
    return str(ChatAnthropic(model=MODEL).invoke("Say hello.").text)


if __name__ == "__main__":
    main({"tools": tools, "tools_stream": tools_stream, "tools_thinking": tools_thinking,
          "plain": plain})
