"""The OpenAI Agents SDK (openai-agents): an agent on a reasoning model with a function tool,
run to its answer (two Responses calls: the tool call, then the answer)."""

from __future__ import annotations

from _report import PROMPT, main, weather
from agents import Agent, ModelSettings, Runner, function_tool, set_tracing_disabled

set_tracing_disabled(True)

MODEL = "gpt-5-mini"


def _agent(**settings: object) -> Agent:
    """The agent with the SDK's own defaults for the model, plus `settings` where a case adds
    one a team would set."""
    agent = Agent(name="assistant", instructions="Answer briefly.", model=MODEL,
                  tools=[function_tool(weather)])
    if settings:
        agent.model_settings = agent.model_settings.resolve(ModelSettings(**settings))
    return agent


async def tools() -> str:
    result = await Runner.run(_agent(), PROMPT)
    return str(result.final_output)


async def tools_stream() -> str:
    result = Runner.run_streamed(_agent(), PROMPT)
    async for _ in result.stream_events():
        pass
    return str(result.final_output)


async def tools_unstored() -> str:
    """`store: false` with the reasoning's `encrypted_content` asked for, as OpenAI's docs say a
    stateless (zero data retention) caller must: step 2 sends the reasoning item back whole."""
    result = await Runner.run(_agent(store=False, response_include=["reasoning.encrypted_content"]),
                              PROMPT)
    return str(result.final_output)


async def plain() -> str:
    result = await Runner.run(Agent(name="assistant", model=MODEL), "Say hello.")
    return str(result.final_output)


if __name__ == "__main__":
    main({"tools": tools, "tools_stream": tools_stream, "tools_unstored": tools_unstored,
          "plain": plain})
