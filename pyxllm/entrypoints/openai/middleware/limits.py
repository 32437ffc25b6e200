"""The request-body size limit, as ASGI middleware: a body over ``max_bytes`` is a 413 before
the app parses any of it (by its ``Content-Length`` at once, else as its chunks arrive), so a
client cannot make the server hold or parse more than that."""

from __future__ import annotations

from fastapi import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pyxllm.entrypoints.openai.errors import error_response, route_path


class BodySizeLimit:
    """Answers 413 (OpenAI's error shape, Anthropic's on its routes) for a request body over
    ``max_bytes`` bytes.

    A declared ``Content-Length`` over the limit is refused before the body is read; a body
    without one (chunked) is counted as it arrives, and the read that passes the limit raises
    FastAPI's ``HTTPException(413)``, which the app answers like any other error.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or ()).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            response = error_response(self._message(int(declared)), 413, path=route_path(scope))
            await response(scope, receive, send)
            return
        received = 0

        async def counted_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise HTTPException(413, self._message(received))
            return message

        await self.app(scope, counted_receive, send)

    def _message(self, size: int) -> str:
        return (
            f"the request body has {size} bytes, more than the {self.max_bytes} this server "
            "takes (--max-request-body-bytes)"
        )


class AdmissionControl:
    """Answers 503 with ``Retry-After`` for a request that does real work (``POST`` to a path
    in ``paths``: generation, tokenization) while ``max_requests`` of them are in progress,
    before its body is read.

    A request counts from its arrival until its response (a stream included) has ended, so
    the work before the engine (parsing, templates, grammars) counts too; refusing here costs
    next to nothing, so a flood cannot delay ``/health`` or the requests admitted.
    """

    def __init__(self, app: ASGIApp, max_requests: int, paths: tuple[str, ...]) -> None:
        self.app, self.max_requests, self.paths = app, max_requests, paths
        self.in_progress = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        post = scope["type"] == "http" and scope["method"] == "POST"
        if not post or route_path(scope) not in self.paths:
            await self.app(scope, receive, send)
            return
        if self.in_progress >= self.max_requests:
            message = (
                f"the server is busy ({self.max_requests} requests in progress, "
                "--max-seqs-per-batch plus --max-waiting-requests); retry later"
            )
            response = error_response(
                message, 503, headers={"Retry-After": "1"}, path=route_path(scope)
            )
            await response(scope, receive, send)
            return
        self.in_progress += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_progress -= 1
