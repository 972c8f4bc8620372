"""How vLLM's HTTP server keeps connections, for the clients that talk to engines."""

from __future__ import annotations

from typing import Any

import aiohttp

ENGINE_KEEP_ALIVE_S = 5.0
"""vLLM closes an idle keep-alive connection after this long (its uvicorn
`--timeout-keep-alive`, `VLLM_HTTP_TIMEOUT_KEEP_ALIVE`, 5 s by default)."""

CLIENT_KEEP_ALIVE_S = 2.0
"""How long a client keeps an idle connection to an engine: well under the engine's, so it is
never reused just as the engine closes it (aiohttp keeps one 15 s by default, and a request
sent on a connection the server closed fails with ServerDisconnectedError)."""


def engine_connector(**kwargs: Any) -> aiohttp.TCPConnector:
    """An aiohttp connector for calls to vLLM engines (`kwargs` go to it as well)."""
    return aiohttp.TCPConnector(keepalive_timeout=CLIENT_KEEP_ALIVE_S, **kwargs)
