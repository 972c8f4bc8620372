"""A multi-agent debate: N agents answer, then for R-1 more rounds each reads the others'
answers and revises its own; a judge picks the winner. Through kvgate each round is a fan-out
and each agent's next turn joins the whole previous round.

    python examples/debate.py --base-url http://127.0.0.1:8000 --model M --agents 3 --rounds 2
"""

from __future__ import annotations

import argparse
import asyncio

from kvgate.sdk import Client, task, workflow

PERSONAS = ["an economist", "an engineer", "a historian", "a philosopher", "a physician"]


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", help="default: the first model the gateway serves")
    parser.add_argument("--topic", default="Should cities replace parking with housing?")
    parser.add_argument("--agents", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()

    async with Client(args.base_url) as kv:
        model = args.model or (await kv.openai.models.list()).data[0].id
        rules = (f"A debate among {args.agents} agents over {args.rounds} rounds on: "
                 f"{args.topic} Argue briefly and answer the others' points.")

        async def ask(system: str, prompt: str) -> str:
            reply = await kv.openai.chat.completions.create(
                model=model, max_tokens=args.max_tokens,
                messages=[{"role": "system", "content": rules},
                          {"role": "system", "content": system},
                          {"role": "user", "content": prompt}])
            return reply.choices[0].message.content or ""

        @task("agent")
        async def speak(agent: int, previous: list[str]) -> str:
            persona = PERSONAS[agent % len(PERSONAS)]
            if not previous:
                return await ask(f"You are {persona}.", "Give your opening position.")
            others = "\n".join(f"Agent {i}: {text}" for i, text in enumerate(previous)
                               if i != agent)
            return await ask(f"You are {persona}.",
                             f"Your last answer: {previous[agent]}\nThe others said:\n{others}"
                             "\nRevise your position.")

        @task("judge")
        async def judge(answers: list[str]) -> str:
            listing = "\n".join(f"Agent {i}: {text}" for i, text in enumerate(answers))
            return await ask("You are the judge.", f"Final positions:\n{listing}\n"
                             "Name the most convincing agent and say why.")

        @workflow("debate")
        async def debate() -> str:
            answers: list[str] = []
            for _ in range(args.rounds):
                answers = list(await asyncio.gather(
                    *(speak(i, answers) for i in range(args.agents))))
            return await judge(answers)

        result = await debate.run()
        print(f"verdict: {result.value!r}")
        snap = await kv.wait(result.id, timeout_s=120)
        print(f"workflow {snap.id}: {snap.state}, {len(snap.tasks)} tasks")
        print(snap.placement())


if __name__ == "__main__":
    asyncio.run(main())
