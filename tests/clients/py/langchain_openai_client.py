"""langchain-openai: ChatOpenAI on the Responses API (`use_responses_api=True`), a reasoning model
with a tool, the tool loop written as LangChain's docs show it (invoke, run the tool, invoke)."""

from __future__ import annotations

from _report import PROMPT, main, weather
from langchain_core.messages import BaseMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI

MODEL = "gpt-5-mini"
weather_tool = tool(weather)


def _loop(llm: ChatOpenAI, stream: bool) -> str:
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
    return _loop(ChatOpenAI(model=MODEL, use_responses_api=True), stream=False)


async def tools_stream() -> str:
    return _loop(ChatOpenAI(model=MODEL, use_responses_api=True), stream=True)


async def tools_reasoning() -> str:
    """A reasoning effort asked for, as LangChain's reasoning-model docs show."""
    return _loop(ChatOpenAI(model=MODEL, use_responses_api=True,
                            reasoning={"effort": "low", "summary": "auto"}), stream=False)


async def tools_unstored() -> str:
    """`store=False` with `include=["reasoning.encrypted_content"]`, as langchain-openai documents
    for stateless use: step 2 sends the reasoning item back whole, with its encrypted content."""
    return _loop(ChatOpenAI(model=MODEL, use_responses_api=True, store=False,
                            include=["reasoning.encrypted_content"]), stream=False)


async def tools_previous_response() -> str:
    """`use_previous_response_id=True`: step 2 sends only what is new, and names step 1's
    response for the rest, which the provider bills again as input."""
    return _loop(ChatOpenAI(model=MODEL, use_responses_api=True, use_previous_response_id=True),
                 stream=False)


async def chat_tools() -> str:
    """The same loop on Chat Completions, ChatOpenAI's default API."""
    return _loop(ChatOpenAI(model=MODEL), stream=False)


async def plain() -> str:
    reply = ChatOpenAI(model=MODEL, use_responses_api=True).invoke("Say hello.")
    return str(reply.text)


if __name__ == "__main__":
    main({"tools": tools, "tools_stream": tools_stream, "tools_reasoning": tools_reasoning,
          "tools_unstored": tools_unstored, "tools_previous_response": tools_previous_response,
          "chat_tools": chat_tools, "plain": plain})
