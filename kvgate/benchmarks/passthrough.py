"""The floor of kvgate's stack, for the proxy microbench: an aiohttp server on uvloop that
forwards every POST to one engine through the gateway's own upstream client, and relays the
answer (streamed chunk by chunk, or whole). No tokenizing, no index, no planner, no metrics, no
tracing: whatever it adds over direct, kvgate can not add less while it serves with aiohttp.

    python -m kvgate.benchmarks.passthrough --engine http://127.0.0.1:8001 --port 8100
"""

from __future__ import annotations

import argparse

from aiohttp import web

from gateway.app import serve
from gateway.proxy import forward_headers
from gateway.upstream import Upstream


def build_app(engine: str) -> web.Application:
    """The pass-through application in front of `engine`."""
    upstream = Upstream(connect_timeout_s=5.0)

    async def forward(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        answer = await upstream.post(engine, request.path, body,
                                     forward_headers(request.headers).items(), 600.0)
        try:
            out = forward_headers(answer.headers)
            if answer.content_type != "text/event-stream":
                resp = web.Response(status=answer.status, body=await answer.read(), headers=out)
                await resp.prepare(request)
                await resp.write_eof()
                return resp
            stream = web.StreamResponse(status=answer.status, headers=out)
            await stream.prepare(request)
            while chunk := await answer.readany():
                await stream.write(chunk)
            await stream.write_eof()
            return stream
        finally:
            answer.release()

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def close(_: web.Application) -> None:
        await upstream.close()

    app = web.Application()
    app.router.add_post("/{tail:.*}", forward)
    app.router.add_get("/health", health)
    app.on_cleanup.append(close)
    return app


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", required=True, help="the engine's base URL")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    args = ap.parse_args()
    serve(lambda: build_app(args.engine), args.host, args.port)


if __name__ == "__main__":
    main()
