"""A LangGraph graph whose model is LangChain's `ChatOpenAI` pointed at kvgate: plan, then two
research branches in parallel, then a writer. The graph's nodes are SDK tasks, and the model's
HTTP client is the SDK's, so every call carries its workflow, task and parents.

    python examples/langgraph_agent.py --base-url http://127.0.0.1:8000 --model M
"""

from __future__ import annotations

import argparse
import asyncio
import operator
from typing import Annotated, Any, TypedDict

from langchain_core.messages import HumanMessage, SystemMessage
from langchain_openai import ChatOpenAI
from langgraph.graph import END, START, StateGraph

from kvgate.sdk import Client, task, workflow


class State(TypedDict):
    question: str
    plan: str
    findings: Annotated[list[str], operator.add]
    report: str


SYSTEM = SystemMessage("You are a research team. Be concrete and brief.")


def build_graph(llm: ChatOpenAI) -> Any:
    """plan -> (pros, cons in parallel) -> write."""

    async def text(prompt: str) -> str:
        reply = await llm.ainvoke([SYSTEM, HumanMessage(prompt)])
        return str(reply.content)

    @task("plan")
    async def plan(state: State) -> dict[str, object]:
        return {"plan": await text(f"Plan how to answer: {state['question']}")}

    @task("pros")
    async def pros(state: State) -> dict[str, object]:
        return {"findings": [await text(f"Plan: {state['plan']}\nList the arguments for.")]}

    @task("cons")
    async def cons(state: State) -> dict[str, object]:
        return {"findings": [await text(f"Plan: {state['plan']}\nList the arguments against.")]}

    @task("write")
    async def write(state: State) -> dict[str, object]:
        notes = "\n".join(state["findings"])
        return {"report": await text(f"Question: {state['question']}\nNotes:\n{notes}\n"
                                     "Write the answer.")}

    graph = StateGraph(State)
    graph.add_node("plan", plan)
    graph.add_node("pros", pros)
    graph.add_node("cons", cons)
    graph.add_node("write", write)
    graph.add_edge(START, "plan")
    graph.add_edge("plan", "pros")
    graph.add_edge("plan", "cons")
    graph.add_edge(["pros", "cons"], "write")
    graph.add_edge("write", END)
    return graph.compile()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", help="default: the first model the gateway serves")
    parser.add_argument("--question", default="Is a four-day work week good for productivity?")
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()

    async with Client(args.base_url) as kv:
        model = args.model or (await kv.openai.models.list()).data[0].id
        llm = ChatOpenAI(base_url=f"{kv.base_url}/v1", api_key="-", model=model,
                         max_tokens=args.max_tokens, http_async_client=kv.http_client)
        app = build_graph(llm)

        @workflow("langgraph")
        async def run(question: str) -> str:
            state = await app.ainvoke({"question": question, "findings": []})
            return str(state["report"])

        result = await run.run(args.question)
        print(f"report: {result.value!r}")
        snap = await kv.wait(result.id, timeout_s=120)
        print(f"workflow {snap.id}: {snap.state}, {len(snap.tasks)} tasks")
        print(snap.placement())


if __name__ == "__main__":
    asyncio.run(main())
