"""The OpenAI Agents SDK against kvgate: two analyst agents (with a calculator tool) work in
parallel, then an editor agent merges their notes. The agents' model is a chat-completions
model over the SDK client's `AsyncOpenAI`, so every call carries its workflow, task and parents.
Tracing export is off: it would send traces to OpenAI's servers.

    python examples/openai_agents_sdk.py --base-url http://127.0.0.1:8000 --model M
"""

from __future__ import annotations

import argparse
import asyncio

from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)

from kvgate.sdk import Client, task, workflow


@function_tool
def multiply(a: float, b: float) -> float:
    """Multiply two numbers."""
    return a * b


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", help="default: the first model the gateway serves")
    parser.add_argument("--brief", default="Estimate the yearly energy use of a 40-engine "
                                           "GPU cluster and how to cut it.")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-turns", type=int, default=3)
    args = parser.parse_args()
    set_tracing_disabled(True)

    async with Client(args.base_url) as kv:
        model_name = args.model or (await kv.openai.models.list()).data[0].id
        model = OpenAIChatCompletionsModel(model=model_name, openai_client=kv.openai)
        settings = ModelSettings(max_tokens=args.max_tokens)
        analysts = [Agent(name=f"{angle} analyst", model=model, model_settings=settings,
                          tools=[multiply],
                          instructions=f"You analyse the {angle} side. Use the tool for sums.")
                    for angle in ("cost", "engineering")]
        editor = Agent(name="editor", model=model, model_settings=settings,
                       instructions="Merge the analysts' notes into one short memo.")

        @task("analyst")
        async def analyse(agent: Agent[None], brief: str) -> str:
            result = await Runner.run(agent, brief, max_turns=args.max_turns)
            return str(result.final_output)

        @task("editor")
        async def edit(notes: list[str]) -> str:
            result = await Runner.run(editor, "\n\n".join(notes), max_turns=args.max_turns)
            return str(result.final_output)

        @workflow("agents-sdk")
        async def memo(brief: str) -> str:
            notes = await asyncio.gather(*(analyse(a, brief) for a in analysts))
            return await edit(list(notes))

        result = await memo.run(args.brief)
        print(f"memo: {result.value!r}")
        snap = await kv.wait(result.id, timeout_s=120)
        print(f"workflow {snap.id}: {snap.state}, {len(snap.tasks)} tasks")
        print(snap.placement())


if __name__ == "__main__":
    asyncio.run(main())
