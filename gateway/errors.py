"""Gateway error types, and the one place that turns them into OpenAI-shaped JSON responses."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web


class GatewayError(Exception):
    """An error the client should see, with an HTTP status and OpenAI's error fields."""

    status = 500
    err_type = "server_error"
    code: str | None = None

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def body(self) -> dict[str, Any]:
        """OpenAI's `{"error": {message, type, param, code}}`."""
        return {
            "error": {
                "message": self.message,
                "type": self.err_type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> web.Response:
        """The JSON response for this error."""
        return web.json_response(self.body(), status=self.status)

    def sse_event(self) -> bytes:
        """This error as a server-sent event, for streams whose headers are already sent."""
        return b"data: " + json.dumps(self.body()).encode() + b"\n\n"


class InvalidRequest(GatewayError):
    """The request body is malformed or misses a required field."""

    status = 400
    err_type = "invalid_request_error"


class ModelNotFound(GatewayError):
    """No engine in the pool serves the requested model."""

    status = 404
    err_type = "invalid_request_error"
    code = "model_not_found"


class BodyTooLarge(GatewayError):
    """The request body exceeds `max_body_bytes`."""

    status = 413
    err_type = "invalid_request_error"
    code = "request_too_large"


class NoHealthyEngine(GatewayError):
    """Every engine that could serve the request is down."""

    status = 503
    err_type = "service_unavailable"
    code = "no_healthy_engine"


class IndexAway(GatewayError):
    """The KV index's store (Redis) cannot be reached for a read that needs it."""

    status = 503
    err_type = "service_unavailable"
    code = "index_unavailable"


class EngineFailed(GatewayError):
    """The engine broke the connection or timed out after the response had started."""

    status = 502
    err_type = "upstream_error"
    code = "engine_failed"


class EngineTimeout(GatewayError):
    """The engine did not answer within `request_timeout_s`."""

    status = 504
    err_type = "upstream_error"
    code = "engine_timeout"
