"""Who may call the server: API keys (``--api-key``) and CORS (``--allowed-origins``).

API keys. With one or more keys (``--api-key``, repeatable or comma-separated, else the
``PYXLLM_API_KEY`` environment variable, comma-separated), every request must send
``Authorization: Bearer <one of the keys>`` or ``x-api-key: <one of the keys>`` (Anthropic's
header), except on the open paths: ``/health`` (load balancers and orchestrators probe it
without credentials; it says only "up" or "down"), ``/version``, FastAPI's API description
(``/openapi.json``, ``/docs``, ``/redoc``: the schema of a public API, and a browser cannot
send the header), the chat page's files (``/``, ``/static/*``; see :mod:`..web_ui`) unless
``--disable-web-ui``, and ``/metrics`` unless ``--protect-metrics``. So ``/v1/*`` (chat,
completions, models, and any route added there later), ``/tokenize``, ``/detokenize`` and
``/debug/*`` need a key. Anything else answers 401 ``AuthenticationError`` in OpenAI's error
shape (Anthropic's ``authentication_error`` on Anthropic's routes), with ``WWW-Authenticate:
Bearer``, before the request body is read. A CORS preflight (``OPTIONS`` with ``Origin`` and
``Access-Control-Request-Method``) passes without a key when CORS is configured, since browsers
never send credentials on one.

Each token supplied (in either header) is compared with every key, each through SHA-256 (so
lengths are equal) and :func:`hmac.compare_digest`, without stopping at a match: the time taken
says neither how much of a key was right nor which key matched. Keys are never logged
(``ServerOptions`` leaves them out of its ``repr``, the banner says only that a key is
required), and a 401 does not echo what the client sent.

Where this differs from vLLM: vLLM's ``--api-key`` (``VLLM_API_KEY``) protects only paths
under ``/v1``, so its ``/tokenize``, ``/detokenize``, ``/metrics`` and debug routes stay open,
and it lets every ``OPTIONS`` request through. pyxllm protects every path but the open ones
above (a route added later is protected by default; an unknown path without a key is a 401,
not a 404, so it reveals nothing), and lets only real preflights through, only with CORS on.
As in vLLM, a key given on the command line wins over the environment variable (prefer the
variable: other local users can read a process's arguments).

CORS. vLLM adds Starlette's ``CORSMiddleware`` allowing every origin by default; pyxllm adds it
only when ``--allowed-origins`` names at least one origin (default closed: browsers on other
sites cannot read the answers). ``--allowed-methods`` and ``--allowed-headers`` default to
``*`` and ``--allow-credentials`` to off, as vLLM's. The CORS middleware wraps the key check, so
a 401 also carries the CORS headers a browser needs to read it.

Both are pure ASGI middleware that pass ``send`` through untouched, so streamed (SSE) responses
are unaffected.
"""

from __future__ import annotations

import hashlib
import hmac

from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

from pyxllm.entrypoints.openai.errors import error_response, route_path
from pyxllm.entrypoints.openai.server_options import ServerOptions

OPEN_PATHS = frozenset(
    {"/health", "/version", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"}
)
METRICS_PATH = "/metrics"
UNAUTHORIZED_MESSAGE = (
    "missing or invalid API key: send it as the header `Authorization: Bearer <key>` "
    "(or `x-api-key: <key>`)"
)


# where a request's key owner goes in the ASGI scope's state (``request.state``)
OWNER_STATE = "api_key_owner"


def key_owner(request) -> str | None:
    """The API key a request was let in with, as a name that is not the key (the start of its
    SHA-256), to keep what the request stores apart from other keys' (stored responses);
    ``None`` on a server without keys."""
    return getattr(request.state, OWNER_STATE, None)


def _digest(token: str | bytes) -> bytes:
    data = token.encode("utf-8", "surrogateescape") if isinstance(token, str) else token
    return hashlib.sha256(data).digest()


class APIKeyMiddleware:
    """Answer 401 unless the request sends ``Authorization: Bearer <key>`` or ``x-api-key:
    <key>`` with one of ``api_keys``, on every path but the open ones (see the module
    docstring).

    Args:
        app: the ASGI app to protect.
        api_keys: the accepted keys (at least one).
        protect_metrics: whether ``/metrics`` needs a key too.
        allow_preflight: let CORS preflight requests through (when CORS is configured).
        open_paths: more paths that need no key (the chat page's files).
    """

    def __init__(
        self,
        app: ASGIApp,
        api_keys: tuple[str, ...],
        protect_metrics: bool = False,
        allow_preflight: bool = False,
        open_paths: frozenset[str] = frozenset(),
    ):
        if not api_keys:
            raise ValueError("APIKeyMiddleware needs at least one API key")
        self.app = app
        self._digests = tuple(_digest(key) for key in api_keys)
        self._open = OPEN_PATHS | open_paths | (set() if protect_metrics else {METRICS_PATH})
        self._allow_preflight = allow_preflight

    def is_open(self, scope: Scope) -> bool:
        """Whether the request may go through without a key."""
        if route_path(scope) in self._open:
            return True
        if self._allow_preflight and scope.get("method") == "OPTIONS":
            names = {name for name, _ in scope.get("headers", ())}
            return b"origin" in names and b"access-control-request-method" in names
        return False

    def key_owner(self, scope: Scope) -> str | None:
        """Which key the request's ``Authorization: Bearer`` or ``x-api-key`` header holds
        (the first that holds one, in that order), as :func:`key_owner` names it (never the
        key itself), or ``None`` for none of them."""
        for token in _supplied_tokens(scope):
            supplied = _digest(token)
            matched = False
            for digest in self._digests:  # every key, no early exit
                matched |= hmac.compare_digest(supplied, digest)
            if matched:
                return supplied.hex()[:16]
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or self.is_open(scope):
            await self.app(scope, receive, send)
            return
        owner = self.key_owner(scope)
        if owner is not None:
            scope.setdefault("state", {})[OWNER_STATE] = owner
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})  # policy violation
            return
        response = error_response(UNAUTHORIZED_MESSAGE, 401, path=route_path(scope))
        response.headers["WWW-Authenticate"] = "Bearer"
        await response(scope, receive, send)


def _supplied_tokens(scope: Scope) -> list[bytes]:
    """The tokens a request offers: the first ``Authorization`` header's, when its scheme is
    ``Bearer``, and the first ``x-api-key`` header's (Anthropic's SDK sends that one)."""
    headers = scope.get("headers", ())
    tokens = []
    header = next((v for k, v in headers if k == b"authorization"), None)
    if header is not None:
        scheme, _, token = header.partition(b" ")
        if scheme.lower() == b"bearer":
            tokens.append(token.strip())
    api_key = next((v for k, v in headers if k == b"x-api-key"), None)
    if api_key is not None:
        tokens.append(api_key.strip())
    return tokens


def install_security(app, options: ServerOptions, open_paths: frozenset[str] = frozenset()) -> None:
    """Add the key check (with ``options.api_keys``; ``open_paths`` need no key, besides
    :data:`OPEN_PATHS`) and CORS (with ``options.allowed_origins``) to ``app``, a
    Starlette/FastAPI app; each only when configured. CORS ends up outermost."""
    cors = bool(options.allowed_origins)
    if options.api_keys:
        app.add_middleware(
            APIKeyMiddleware,
            api_keys=options.api_keys,
            protect_metrics=options.protect_metrics,
            allow_preflight=cors,
            open_paths=open_paths,
        )
    if cors:  # added last: runs first
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(options.allowed_origins),
            allow_methods=list(options.allowed_methods),
            allow_headers=list(options.allowed_headers),
            allow_credentials=options.allow_credentials,
        )
