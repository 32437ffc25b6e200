"""What ``pyxllm serve`` does around the engine: where it listens, who may call it, how much one
request and the whole server may ask for, and how it stops.

:class:`ServerOptions` is built from the serve flags (``entrypoints/cli.py``) and read by
:func:`~pyxllm.entrypoints.openai.api_server.build_app` and ``run_server``; tests build one
directly. The defaults are the flags' defaults.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class ServerOptions:
    """The HTTP server's settings (the engine's are :class:`~pyxllm.config.EngineConfig`).

    Attributes:
        host, port: where to listen.
        log_level: uvicorn's log level (its access log is off).
        reasoning_parser: the parser splitting chat text into ``reasoning_content`` and
            ``content`` (a registered name), ``None`` for none.
        tool_call_parser: the parser of the model's own calls for ``tool_choice: "auto"``;
            ``None`` refuses ``auto``.
        api_keys: the accepted ``Authorization: Bearer`` keys; empty: no key needed. Left out
            of ``repr`` so they never reach a log (see :mod:`.security`).
        protect_metrics: whether ``/metrics`` needs a key too (``/health`` never does).
        ssl_keyfile, ssl_certfile: the server's TLS key and certificate (PEM); with a
            certificate the server speaks HTTPS only.
        ssl_ca_certs: CA certificates (PEM) that client certificates are checked against.
        ssl_cert_reqs: whether a client certificate is needed, as :mod:`ssl`'s ints
            (0 ``CERT_NONE``, 1 ``CERT_OPTIONAL``, 2 ``CERT_REQUIRED``), uvicorn's setting.
        allowed_origins: the origins CORS allows (``"*"`` for any); empty: no CORS at all.
        allowed_methods, allowed_headers: the methods and request headers CORS allows.
        allow_credentials: whether CORS allows credentials (cookies, ``Authorization``).
    """

    host: str = "127.0.0.1"
    port: int = 8000
    log_level: str = "warning"
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    protect_metrics: bool = False
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    ssl_ca_certs: str | None = None
    ssl_cert_reqs: int = 0
    allowed_origins: tuple[str, ...] = ()
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
