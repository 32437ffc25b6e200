"""What ``pyxllm serve`` does around the engine: where it listens, who may call it, how much one
request and the whole server may ask for, and how it stops.

:class:`ServerOptions` is built from the serve flags (``entrypoints/cli.py``) and read by
:func:`~pyxllm.entrypoints.openai.api_server.build_app` and ``run_server``; tests build one
directly. The defaults are the flags' defaults.
"""

from __future__ import annotations

from dataclasses import dataclass


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
    """

    host: str = "127.0.0.1"
    port: int = 8000
    log_level: str = "warning"
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None
