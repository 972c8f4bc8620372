"""A ReAct agent with a local calculator tool: think, call the tool, read the result, repeat.
Through kvgate each turn extends the previous one (a chain), so it lands where its context is.

The loop never trusts the model's text: a turn either calls the calculator (an OpenAI tool call,
or a line `calc: EXPRESSION`), gives the answer (`final answer: ...`), or says something the
loop cannot read, which is fed back as an observation. It stops after --turns turns at most.

    python examples/react_tool_loop.py --base-url http://127.0.0.1:8000 --model M
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import json
import operator
import re
from typing import Any

from kvgate.sdk import Client, task, workflow

CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                   "required": ["expression"]}}}

SYSTEM = ("Solve the user's problem step by step. To compute, call the calculator tool or write "
          "a line `calc: EXPRESSION`. When done, write `final answer: VALUE`.")

_OPS: dict[type, Any] = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
                         ast.Div: operator.truediv, ast.Pow: operator.pow, ast.USub: operator.neg,
                         ast.Mod: operator.mod, ast.FloorDiv: operator.floordiv}


def calculate(expression: str) -> str:
    """The calculator tool: + - * / // % ** and parentheses over numbers; an error message
    (never an exception) for anything else."""
    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 64:
                raise ValueError("exponent too large")
            return float(_OPS[type(node.op)](left, right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return float(_OPS[type(node.op)](value(node.operand)))
        raise ValueError(f"unsupported: {ast.dump(node)[:40]}")

    try:
        result = value(ast.parse(expression.strip(), mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError, RecursionError) as e:
        return f"error: {e}"
    return f"{result:g}"


def read_turn(message: Any) -> tuple[str, str]:
    """What a turn asked for: ("tool", expression), ("final", answer) or ("unreadable", text)."""
    for call in message.tool_calls or []:
        if call.function.name == "calculator":
            try:
                args = json.loads(call.function.arguments or "{}")
                return "tool", str(args["expression"])
            except (json.JSONDecodeError, KeyError, TypeError):
                return "unreadable", call.function.arguments or ""
    text = message.content or ""
    final = re.search(r"final answer:\s*(.+)", text, re.IGNORECASE)
    if final:
        return "final", final.group(1).strip()
    calc = re.search(r"calc:\s*([-+*/%().\d\s]+)", text, re.IGNORECASE)
    if calc:
        return "tool", calc.group(1)
    return "unreadable", text


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", help="default: the first model the gateway serves")
    parser.add_argument("--problem", default="A crate holds 17 boxes of 23 apples, plus 4 "
                                             "loose apples. How many apples in all?")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()

    async with Client(args.base_url) as kv:
        model = args.model or (await kv.openai.models.list()).data[0].id

        @task("turn")
        async def turn(messages: list[dict[str, Any]]) -> Any:
            reply = await kv.openai.chat.completions.create(
                model=model, messages=messages, tools=[CALCULATOR],
                max_tokens=args.max_tokens)
            return reply.choices[0].message

        @workflow("react")
        async def agent(problem: str) -> str | None:
            messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM},
                                              {"role": "user", "content": problem}]
            for n in range(1, args.turns + 1):
                message = await turn(messages)
                kind, detail = read_turn(message)
                messages.append({"role": "assistant", "content": message.content or ""})
                if kind == "final":
                    return detail
                if kind == "tool":
                    observation = f"calculator({detail.strip()}) = {calculate(detail)}"
                else:
                    observation = ("I could not read a tool call or a final answer; use "
                                   "`calc: EXPRESSION` or `final answer: VALUE`.")
                print(f"turn {n}: {kind}: {observation}")
                messages.append({"role": "user", "content": observation})
            return None

        result = await agent.run(args.problem)
        print(f"answer: {result.value!r}")
        snap = await kv.wait(result.id, timeout_s=120)
        print(f"workflow {snap.id}: {snap.state}, {len(snap.tasks)} tasks")
        print(snap.placement())


if __name__ == "__main__":
    asyncio.run(main())
