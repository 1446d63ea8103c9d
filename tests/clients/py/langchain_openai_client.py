"""langchain-openai: ChatOpenAI on the Responses API (`use_responses_api=True`), a reasoning model
with a tool, the tool loop written as LangChain's docs show it (invoke, run the tool, invoke)."""

from __future__ import annotations

from _langchain_loop import tool_loop
from _report import main
from langchain_openai import ChatOpenAI

MODEL = "gpt-5-mini"


async def tools() -> str:
    return tool_loop(ChatOpenAI(model=MODEL, use_responses_api=True), stream=False)


async def tools_stream() -> str:
    return tool_loop(ChatOpenAI(model=MODEL, use_responses_api=True), stream=True)


async def tools_reasoning() -> str:
    """A reasoning effort asked for, as LangChain's reasoning-model docs show."""
    return tool_loop(ChatOpenAI(model=MODEL, use_responses_api=True,
                                reasoning={"effort": "low", "summary": "auto"}), stream=False)


async def tools_unstored() -> str:
    """`store=False` with `include=["reasoning.encrypted_content"]`, as langchain-openai documents
    for stateless use: step 2 sends the reasoning item back whole, with its encrypted content."""
    return tool_loop(ChatOpenAI(model=MODEL, use_responses_api=True, store=False,
                                include=["reasoning.encrypted_content"]), stream=False)


async def tools_previous_response() -> str:
    """`use_previous_response_id=True`: step 2 sends only what is new, and names step 1's
    response for the rest, which the provider bills again as input."""
    return tool_loop(ChatOpenAI(model=MODEL, use_responses_api=True, use_previous_response_id=True),
                     stream=False)


async def chat_tools() -> str:
    """The same loop on Chat Completions, ChatOpenAI's default API."""
    return tool_loop(ChatOpenAI(model=MODEL), stream=False)


async def plain() -> str:
    reply = ChatOpenAI(model=MODEL, use_responses_api=True).invoke("Say hello.")
    return str(reply.text)


if __name__ == "__main__":
    main({"tools": tools, "tools_stream": tools_stream, "tools_reasoning": tools_reasoning,
          "tools_unstored": tools_unstored, "tools_previous_response": tools_previous_response,
          "chat_tools": chat_tools, "plain": plain})
