"""A map-reduce researcher: a planner splits a question, workers answer the parts in parallel,
a reducer writes the report. Through kvgate the workers are a fan-out of the plan (they share
its prompt), and the reducer joins them.

    python examples/map_reduce_researcher.py --base-url http://127.0.0.1:8000 --model M
"""

from __future__ import annotations

import argparse
import asyncio

from kvgate.sdk import Client, task, workflow

SYSTEM = ("You are a meticulous research assistant. You cite sources, separate facts from "
          "guesses, and answer in short paragraphs.")


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", help="default: the first model the gateway serves")
    parser.add_argument("--question", default="How do KV caches make LLM agents faster?")
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()

    async with Client(args.base_url) as kv:
        model = args.model or (await kv.openai.models.list()).data[0].id

        async def ask(prompt: str) -> str:
            reply = await kv.openai.chat.completions.create(
                model=model, max_tokens=args.max_tokens,
                messages=[{"role": "system", "content": SYSTEM},
                          {"role": "user", "content": prompt}])
            return reply.choices[0].message.content or ""

        @task(expect_children=args.workers)
        async def plan(question: str) -> list[str]:
            outline = await ask(f"Split this question into {args.workers} parts, one a line: "
                                f"{question}")
            lines = [line.strip() for line in outline.splitlines() if line.strip()]
            # A model may give fewer lines than asked (a tiny test model gives noise): pad.
            lines += [f"Part {i + 1} of: {question}" for i in range(len(lines), args.workers)]
            return lines[:args.workers]

        @task
        async def research(part: str) -> str:
            return await ask(f"Research this and report the key facts: {part}")

        @task
        async def reduce(question: str, notes: list[str]) -> str:
            joined = "\n".join(f"- {n}" for n in notes)
            return await ask(f"Question: {question}\nNotes:\n{joined}\nWrite the report.")

        @workflow("map-reduce")
        async def researcher(question: str) -> str:
            parts = await plan(question)
            notes = await asyncio.gather(*(research(p) for p in parts))
            return await reduce(question, list(notes))

        result = await researcher.run(args.question)
        print(f"report: {result.value!r}")
        snap = await kv.wait(result.id, timeout_s=120)
        print(f"workflow {snap.id}: {snap.state}, {len(snap.tasks)} tasks")
        print(snap.placement())


if __name__ == "__main__":
    asyncio.run(main())
