"""pydantic-ai (pydantic-ai-slim[openai,anthropic]): an agent with a tool on OpenAI's Responses
API (OpenAIResponsesModel, a reasoning model) and on Anthropic's Messages API."""

from __future__ import annotations

from _report import PROMPT, main, weather
from pydantic_ai import Agent

OPENAI_MODEL = "openai-responses:gpt-5-mini"
ANTHROPIC_MODEL = "anthropic:claude-sonnet-4-5"


def _agent(model: str) -> Agent[None, str]:
    return Agent(model, instructions="Answer briefly.", tools=[weather])


async def responses_tools() -> str:
    return (await _agent(OPENAI_MODEL).run(PROMPT)).output


async def responses_tools_stream() -> str:
    async with _agent(OPENAI_MODEL).run_stream(PROMPT) as run:
        return await run.get_output()


async def anthropic_tools() -> str:
    return (await _agent(ANTHROPIC_MODEL).run(PROMPT)).output


if __name__ == "__main__":
    main({"responses_tools": responses_tools, "responses_tools_stream": responses_tools_stream,
          "anthropic_tools": anthropic_tools})
