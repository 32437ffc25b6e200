"""``pyxllm disagg-proxy``: prefill/decode disaggregation in front of two kinds of servers.

Each ``POST /v1/completions`` or ``/v1/chat/completions`` goes first to a prefill instance
(``pyxllm serve ... --kv-offload-dir DIR --kv-role prefill``) as the same request cut to one
new token (:func:`prefill_body`): computing its prompt writes the prompt's full KV blocks into
the shared ``DIR`` before that answer returns. The whole request then goes to a decode instance
(``--kv-offload-dir DIR --kv-role decode``), which reads those blocks back as prefix-cache hits
instead of computing them, computes the tail of the prompt that does not fill a block, and
generates; its answer (a stream or one JSON body) is passed back as it comes. vLLM's
disaggregated-prefill proxy and SGLang's PD router work the same way, with KV moved over a
network connector rather than a directory.

Nothing depends on the prefill step succeeding: if the prefill instance is down, refuses the
request or answers late, the decode instance finds fewer blocks (or none) and computes the
rest of the prompt itself, so the answer is the same, only slower (``prefill_failures`` in
``GET /stats`` counts these). Several ``--prefill`` and ``--decode`` URLs take turns.

The proxy loads no model and no torch; ``httpx`` (a dependency of ``openai``) is its client.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

logger = logging.getLogger(__name__)

ROUTES = ("/v1/completions", "/v1/chat/completions")
# request headers passed on to both instances
FORWARDED_HEADERS = ("authorization", "x-api-key", "x-request-id")
# fields a prefill request drops: another output's settings, never the prompt's
PREFILL_DROPPED = (
    "stream",
    "stream_options",
    "n",
    "best_of",
    "use_beam_search",
    "min_tokens",
    "logprobs",
    "top_logprobs",
    "prompt_logprobs",
    "echo",
)


def prefill_body(body: dict) -> dict:
    """The prefill instance's request for ``body`` (a completion or chat request): the same
    prompt and settings that decide its tokens (model, messages, template arguments, tools,
    LoRA adapter, cache salt), one new token, no stream, no logprobs."""
    out = {k: v for k, v in body.items() if k not in PREFILL_DROPPED}
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    return out


class DisaggProxy:
    """Sends requests through a prefill instance, then a decode instance (see the module doc).

    Args:
        prefill_urls / decode_urls: the instances' roots (``http://host:port``), taken in turn.
        timeout: seconds a request to an instance may take.

    Attributes:
        stats: ``requests`` sent on, and ``prefill_failures`` (prefill steps that failed: the
            decode instance computed the prompt itself).
    """

    def __init__(self, prefill_urls: list[str], decode_urls: list[str], timeout: float) -> None:
        if not prefill_urls or not decode_urls:
            raise ValueError("--prefill and --decode: give at least one URL each")
        self.prefill_urls = [u.rstrip("/") for u in prefill_urls]
        self.decode_urls = [u.rstrip("/") for u in decode_urls]
        self._prefill = itertools.cycle(self.prefill_urls)
        self._decode = itertools.cycle(self.decode_urls)
        self.client = httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=None))
        self.stats = {"requests": 0, "prefill_failures": 0}

    async def prefill(self, path: str, body: dict, headers: dict[str, str]) -> None:
        """Run ``body``'s prefill on the next prefill instance; a failure is logged and
        counted, never raised."""
        url = next(self._prefill) + path
        try:
            response = await self.client.post(url, json=prefill_body(body), headers=headers)
            if response.status_code == 200:
                return
            reason = f"HTTP {response.status_code}: {response.text[:200]}"
        except httpx.HTTPError as exc:
            reason = f"{type(exc).__name__}: {exc}"
        self.stats["prefill_failures"] += 1
        logger.warning("prefill at %s failed (%s): the decode instance computes it", url, reason)

    async def forward(self, request: Request) -> Response:
        """Handle one completion or chat request: prefill, then decode, streamed back."""
        try:
            body = json.loads(await request.body())
        except ValueError:
            body = None
        if not isinstance(body, dict):
            return _error("the request body must be a JSON object", "body")
        headers = {k: v for k, v in request.headers.items() if k.lower() in FORWARDED_HEADERS}
        path = request.url.path
        self.stats["requests"] += 1
        await self.prefill(path, body, headers)
        url = next(self._decode) + path
        upstream = self.client.build_request("POST", url, json=body, headers=headers)
        try:
            response = await self.client.send(upstream, stream=True)
        except httpx.HTTPError as exc:
            return _error(f"the decode instance {url} failed: {type(exc).__name__}", None, 502)
        media_type = response.headers.get("content-type")
        if not body.get("stream"):
            content = await response.aread()
            await response.aclose()
            return Response(content, response.status_code, media_type=media_type)
        return StreamingResponse(
            response.aiter_raw(),
            response.status_code,
            media_type=media_type,
            background=BackgroundTask(response.aclose),
        )

    async def passthrough(self, request: Request) -> Response:
        """A ``GET`` answered by the first decode instance (``/v1/models``, ``/version``)."""
        try:
            response = await self.client.get(self.decode_urls[0] + request.url.path)
        except httpx.HTTPError as exc:
            return _error(f"the decode instance failed: {type(exc).__name__}", None, 502)
        media_type = response.headers.get("content-type")
        return Response(response.content, response.status_code, media_type=media_type)

    async def health(self) -> Response:
        """200 when every instance answers ``/health`` with 200, else 503 naming the others."""
        down = []
        for url in (*self.prefill_urls, *self.decode_urls):
            try:
                ok = (await self.client.get(url + "/health")).status_code == 200
            except httpx.HTTPError:
                ok = False
            if not ok:
                down.append(url)
        if down:
            return _error(f"instances not healthy: {', '.join(down)}", None, 503)
        return Response(status_code=200)


def _error(message: str, param: str | None, status_code: int = 400) -> JSONResponse:
    """An error in OpenAI's shape."""
    kind = "invalid_request_error" if status_code == 400 else "server_error"
    error = {"message": message, "type": kind, "param": param, "code": status_code}
    return JSONResponse({"error": error}, status_code=status_code)


def build_proxy_app(proxy: DisaggProxy) -> FastAPI:
    """The proxy's routes: :data:`ROUTES`, ``GET /v1/models``, ``/version``, ``/health`` and
    ``/stats`` (the proxy's counters)."""

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        yield
        await proxy.client.aclose()

    app = FastAPI(
        title="pyxllm disagg-proxy",
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
        lifespan=lifespan,
    )
    for route in ROUTES:
        app.add_api_route(route, proxy.forward, methods=["POST"])
    for route in ("/v1/models", "/version"):
        app.add_api_route(route, proxy.passthrough, methods=["GET"])
    app.add_api_route("/health", proxy.health, methods=["GET"])
    app.add_api_route("/stats", lambda: JSONResponse(proxy.stats), methods=["GET"])
    return app


def run_proxy(
    prefill_urls: list[str], decode_urls: list[str], host: str, port: int, timeout: float
) -> None:
    """Serve the proxy on ``host:port`` until interrupted."""
    import uvicorn

    app = build_proxy_app(DisaggProxy(prefill_urls, decode_urls, timeout))
    print(
        f"pyxllm disagg-proxy on http://{host}:{port}: prefill {', '.join(prefill_urls)}, "
        f"decode {', '.join(decode_urls)}",
        flush=True,
    )
    uvicorn.run(app, host=host, port=port, log_level="warning", access_log=False)
