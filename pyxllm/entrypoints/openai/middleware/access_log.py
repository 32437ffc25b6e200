"""One log line per HTTP request: client, method, path, status and duration.

vLLM leaves this to uvicorn's access log (``--disable-uvicorn-access-log`` turns it off); ours
is an ASGI middleware instead because uvicorn's line has no duration and is written when the
response starts, so a streamed completion would be logged before its first token. This one
is written as the last part of the body is sent (or when the client went away), so the
duration of a stream is the whole stream's, and it sits outside every other middleware, so a
401, 413 or 503 they answer is logged too. The logger is ``pyxllm.access`` (INFO).
"""

from __future__ import annotations

import logging
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

logger = logging.getLogger("pyxllm.access")


class AccessLog:
    """Logs ``CLIENT "METHOD PATH HTTP/V" STATUS DURATION ms`` per HTTP request; the status is
    ``-`` when the app raised or the client left before a response started."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start, status, logged = time.perf_counter(), None, False

        def log() -> None:
            nonlocal logged
            if logged:
                return
            logged = True
            host, port = scope.get("client") or ("-", 0)
            path = scope["path"]  # as the client sent it (ASGI: with any root_path in it)
            if scope.get("query_string"):
                path += "?" + scope["query_string"].decode("latin-1")
            logger.info(
                '%s:%d "%s %s HTTP/%s" %s %.1f ms',
                host,
                port,
                scope["method"],
                path,
                scope.get("http_version", "1.1"),
                "-" if status is None else status,
                (time.perf_counter() - start) * 1e3,
            )

        async def logged_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                log()  # before the last send: the line is written when the client has it all
            await send(message)

        try:
            await self.app(scope, receive, logged_send)
        finally:
            log()  # an exception, or a client that left mid-stream
