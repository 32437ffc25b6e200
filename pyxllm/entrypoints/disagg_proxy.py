"""``pyxllm disagg-proxy``: prefill/decode disaggregation in front of two kinds of servers.

Each ``POST /v1/completions``, ``/v1/chat/completions``, ``/v1/responses`` (OpenAI's Responses
API) or ``/v1/messages`` (Anthropic's Messages API) goes first to a prefill instance
(``pyxllm serve ... --kv-offload-dir DIR --kv-role prefill``) as the same request cut to one
new token (:func:`prefill_body`): computing its prompt writes the prompt's full KV blocks into
the shared ``DIR`` before that answer returns. The whole request then goes to a decode instance
(``--kv-offload-dir DIR --kv-role decode``), which reads those blocks back as prefix-cache hits
instead of computing them, computes the tail of the prompt that does not fill a block, and
generates; its answer (a stream or one JSON body, an error with its status) is passed back as
it comes. Between hosts the prefill instance pushes the blocks over TCP instead
(``--kv-transfer-push``); given each decode instance's ``--kv-transfer-listen`` address
(``--decode-kv-listen``), the proxy picks the decode instance first and names it in the
prefill request's ``kv_transfer_params``, so only that instance gets the blocks. vLLM's
disaggregated-prefill proxy and SGLang's PD router work the same way, with KV moved over a
network connector rather than a directory.

Nothing depends on the prefill step succeeding: if the prefill instance is down, refuses the
request or answers late, the decode instance finds fewer blocks (or none) and computes the
rest of the prompt itself, so the answer is the same, only slower (``prefill_failures`` in
``GET /stats`` counts these). A Responses request that continues a stored response
(``previous_response_id``) skips the prefill step: the conversation is stored on the decode
instance that answered it, which also holds its KV in its prefix cache, so the request goes to
that instance (``prefill_skipped`` counts these). Several ``--prefill`` and ``--decode`` URLs
take turns.

The proxy loads no model and no torch; ``httpx`` (a dependency of ``openai``) is its client.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import urllib.parse

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from pyxllm.engine.kv_transfer import parse_address
from pyxllm.entrypoints.anthropic.errors import ANTHROPIC_PATHS, anthropic_error_body
from pyxllm.entrypoints.log_setup import ensure_logging

logger = logging.getLogger(__name__)

# the routes split in two, each with its API's name for the limit on new tokens
ROUTES = {
    "/v1/completions": "max_tokens",
    "/v1/chat/completions": "max_tokens",
    "/v1/responses": "max_output_tokens",
    "/v1/messages": "max_tokens",
}
# routes passed to a decode instance as they are
PASSED_POSTS = ("/v1/messages/count_tokens",)
PASSED_GETS = ("/v1/models", "/version")
# request headers passed on to both instances
FORWARDED_HEADERS = (
    "authorization",
    "x-api-key",
    "x-request-id",
    "anthropic-version",
    "anthropic-beta",
)
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
    # the Responses API's: logprobs in the output, a run in the background
    "include",
    "background",
)


def prefill_body(
    body: dict, path: str = "/v1/completions", decode_kv: tuple[str, int] | None = None
) -> dict | None:
    """The prefill instance's request for ``body``, a request to ``path`` (a key of
    :data:`ROUTES`): the same prompt and settings that decide its tokens (model, messages or
    input, instructions or system prompt, template arguments, tools, LoRA adapter, cache
    salt), one new token (in that API's field), no stream, no logprobs, and for the Responses
    API not stored. With ``decode_kv`` (``(host, port)``: the ``--kv-transfer-listen`` address
    of the decode instance that will run the request), ``kv_transfer_params`` (vLLM's field,
    which the prefill instance takes on each of these routes) names it, so the prefill
    instance pushes the request's KV blocks there only. ``None`` when the request has no
    prefill step: a Responses request that continues a stored response
    (``previous_response_id``), which only the decode instance that answered it holds."""
    if path == "/v1/responses" and body.get("previous_response_id") is not None:
        return None
    out = {k: v for k, v in body.items() if k not in PREFILL_DROPPED}
    if decode_kv is not None:
        host, port = decode_kv
        out["kv_transfer_params"] = {
            "do_remote_decode": True,
            "remote_host": host,
            "remote_port": port,
        }
    out[ROUTES.get(path, "max_tokens")] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    if path == "/v1/responses":
        out["store"] = False
    return out


class DisaggProxy:
    """Sends requests through a prefill instance, then a decode instance (see the module doc).

    Args:
        prefill_urls / decode_urls: the instances' roots (``http://host:port``), taken in turn.
        timeout: seconds a request to an instance may take.
        decode_kv: the decode instances' ``--kv-transfer-listen`` addresses (``HOST:PORT``),
            one for each of ``decode_urls`` in order, or ``None`` (the prefill instances push
            each block to all their peers, or share a directory).

    Raises:
        ValueError: no URL of a kind, not one ``decode_kv`` address per decode URL, or one
            that is not ``HOST:PORT``.

    Attributes:
        stats: ``requests`` sent on, ``prefill_failures`` (prefill steps that failed: the
            decode instance computed the prompt itself) and ``prefill_skipped`` (requests with
            no prefill step, see :func:`prefill_body`).
    """

    def __init__(
        self,
        prefill_urls: list[str],
        decode_urls: list[str],
        timeout: float,
        decode_kv: list[str] | None = None,
    ) -> None:
        if not prefill_urls or not decode_urls:
            raise ValueError("--prefill and --decode: give at least one URL each")
        if decode_kv is not None and len(decode_kv) != len(decode_urls):
            raise ValueError("--decode-kv-listen: give one for each --decode, in their order")
        self.prefill_urls = [u.rstrip("/") for u in prefill_urls]
        self.decode_urls = [u.rstrip("/") for u in decode_urls]
        self.decode_kv = {
            url: parse_address(address, "--decode-kv-listen")
            for url, address in zip(self.decode_urls, decode_kv or ())
        }
        self._prefill = itertools.cycle(self.prefill_urls)
        self._decode = itertools.cycle(self.decode_urls)
        self.client = httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=None))
        self.stats = {"requests": 0, "prefill_failures": 0, "prefill_skipped": 0}

    async def prefill(
        self, path: str, body: dict, headers: dict[str, str], decode_url: str | None = None
    ) -> None:
        """Run ``body``'s prefill on the next prefill instance, its KV bound for
        ``decode_url``'s instance when :attr:`decode_kv` knows its address; a failure is
        logged and counted, never raised."""
        request = prefill_body(body, path, self.decode_kv.get(decode_url))
        if request is None:
            self.stats["prefill_skipped"] += 1
            return
        url = next(self._prefill) + path
        try:
            response = await self.client.post(url, json=request, headers=headers)
            if response.status_code == 200:
                return
            reason = f"HTTP {response.status_code}: {response.text[:200]}"
        except httpx.HTTPError as exc:
            reason = f"{type(exc).__name__}: {exc}"
        self.stats["prefill_failures"] += 1
        logger.warning("prefill at %s failed (%s): the decode instance computes it", url, reason)

    async def holder(self, response_id: str, headers: dict[str, str]) -> str | None:
        """The decode instance that stores the Responses API's response ``response_id``
        (``None`` when none answers 200 for it)."""
        for url in self.decode_urls:
            with contextlib.suppress(httpx.HTTPError):
                stored = f"{url}/v1/responses/{urllib.parse.quote(response_id, safe='')}"
                if (await self.client.get(stored, headers=headers)).status_code == 200:
                    return url
        return None

    async def decode_url(self, body: dict, headers: dict[str, str]) -> str:
        """The decode instance for ``body``: the one that stores the response a Responses
        request continues (``previous_response_id``), else the next in turn."""
        previous = body.get("previous_response_id")
        if isinstance(previous, str) and len(self.decode_urls) > 1:
            url = await self.holder(previous, headers)
            if url is not None:
                return url
        return next(self._decode)

    async def forward(self, request: Request) -> Response:
        """Handle one request to a route of :data:`ROUTES`: prefill, then decode, streamed
        back."""
        path = request.url.path
        try:
            body = json.loads(await request.body())
        except ValueError:
            body = None
        if not isinstance(body, dict):
            return _error(path, "the request body must be a JSON object", "body")
        headers = _forwarded(request)
        self.stats["requests"] += 1
        decode = await self.decode_url(body, headers)
        await self.prefill(path, body, headers, decode)
        url = decode + path
        return await self._send(
            path,
            self.client.build_request("POST", url, json=body, headers=headers),
            bool(body.get("stream")),
        )

    async def passthrough(self, request: Request) -> Response:
        """A request answered by a decode instance as it is: ``GET /v1/models`` and
        ``/version`` by the first, ``POST /v1/messages/count_tokens`` by the next in turn, and
        ``GET`` or ``DELETE /v1/responses/{id}`` by the one that stores that response (the
        first's 404 when none does)."""
        path = request.url.path
        headers = _forwarded(request)
        if path in PASSED_POSTS:
            url = next(self._decode) + path
            content = await request.body()
            headers["content-type"] = request.headers.get("content-type", "application/json")
            upstream = self.client.build_request("POST", url, content=content, headers=headers)
            return await self._send(path, upstream, stream=False)
        url = self.decode_urls[0]
        if len(self.decode_urls) > 1 and "response_id" in request.path_params:
            url = await self.holder(request.path_params["response_id"], headers) or url
        upstream = self.client.build_request(request.method, url + path, headers=headers)
        return await self._send(path, upstream, stream=False)

    async def _send(self, path: str, upstream: httpx.Request, stream: bool) -> Response:
        """``upstream``'s answer passed back as it comes (a stream when ``stream``), its status
        and media type kept; a 502 when the instance does not answer."""
        try:
            response = await self.client.send(upstream, stream=True)
        except httpx.HTTPError as exc:
            message = f"the decode instance {upstream.url} failed: {type(exc).__name__}"
            return _error(path, message, None, 502)
        media_type = response.headers.get("content-type")
        if not stream:
            content = await response.aread()
            await response.aclose()
            return Response(content, response.status_code, media_type=media_type)
        return StreamingResponse(
            response.aiter_raw(),
            response.status_code,
            media_type=media_type,
            background=BackgroundTask(response.aclose),
        )

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
            return _error("/health", f"instances not healthy: {', '.join(down)}", None, 503)
        return Response(status_code=200)


def _forwarded(request: Request) -> dict[str, str]:
    """``request``'s headers of :data:`FORWARDED_HEADERS`."""
    return {k: v for k, v in request.headers.items() if k.lower() in FORWARDED_HEADERS}


def _error(path: str, message: str, param: str | None, status_code: int = 400) -> JSONResponse:
    """An error in the shape of ``path``'s API: Anthropic's on its routes, else OpenAI's."""
    if path in ANTHROPIC_PATHS:
        body = anthropic_error_body(f"{param}: {message}" if param else message, status_code)
        return JSONResponse(body, status_code=status_code)
    kind = "invalid_request_error" if status_code == 400 else "server_error"
    error = {"message": message, "type": kind, "param": param, "code": status_code}
    return JSONResponse({"error": error}, status_code=status_code)


def build_proxy_app(proxy: DisaggProxy) -> FastAPI:
    """The proxy's routes: :data:`ROUTES`, :data:`PASSED_POSTS`, :data:`PASSED_GETS`,
    ``GET`` and ``DELETE /v1/responses/{id}``, ``/health`` and ``/stats`` (the proxy's
    counters)."""

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
    for route in PASSED_POSTS:
        app.add_api_route(route, proxy.passthrough, methods=["POST"])
    for route in PASSED_GETS:
        app.add_api_route(route, proxy.passthrough, methods=["GET"])
    app.add_api_route("/v1/responses/{response_id}", proxy.passthrough, methods=["GET", "DELETE"])
    app.add_api_route("/health", proxy.health, methods=["GET"])
    app.add_api_route("/stats", lambda: JSONResponse(proxy.stats), methods=["GET"])
    return app


def run_proxy(
    prefill_urls: list[str],
    decode_urls: list[str],
    host: str,
    port: int,
    timeout: float,
    decode_kv: list[str] | None = None,
) -> None:
    """Serve the proxy on ``host:port`` until interrupted (``decode_kv``: see
    :class:`DisaggProxy`)."""
    import uvicorn

    ensure_logging()  # the servers' format: level, time, logger
    app = build_proxy_app(DisaggProxy(prefill_urls, decode_urls, timeout, decode_kv))
    logger.info(
        "pyxllm disagg-proxy on http://%s:%d: prefill %s, decode %s",
        host,
        port,
        ", ".join(prefill_urls),
        ", ".join(decode_urls),
    )
    uvicorn.run(app, host=host, port=port, log_level="warning", access_log=False)
