"""langchain-anthropic: ChatAnthropic with a tool, the tool loop as LangChain's docs show it."""

from __future__ import annotations

from _langchain_loop import tool_loop
from _report import main
from langchain_anthropic import ChatAnthropic

MODEL = "claude-sonnet-4-5"


async def tools() -> str:
    return tool_loop(ChatAnthropic(model=MODEL), stream=False)


async def tools_stream() -> str:
    return tool_loop(ChatAnthropic(model=MODEL), stream=True)


async def tools_thinking() -> str:
    """Extended thinking on: the thinking blocks (with their signatures) go back in step 2."""
    return tool_loop(ChatAnthropic(model=MODEL, max_tokens=4096,
                                   thinking={"type": "enabled", "budget_tokens": 2048}),
                     stream=False)


async def plain() -> str:
    return str(ChatAnthropic(model=MODEL).invoke("Say hello.").text)


if __name__ == "__main__":
    main({"tools": tools, "tools_stream": tools_stream, "tools_thinking": tools_thinking,
          "plain": plain})
