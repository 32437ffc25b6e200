"""``pyxllm disagg-proxy``: prefill/decode disaggregation's router
(:mod:`pyxllm.entrypoints.disagg_proxy`)."""

from __future__ import annotations

import argparse

from pyxllm.config import EngineConfig
from pyxllm.engine.kv_transfer import parse_address


def add_parser(commands, formatter) -> argparse.ArgumentParser:
    """The ``disagg-proxy`` parser."""
    proxy = commands.add_parser(
        "disagg-proxy",
        help="route requests through a prefill server, then a decode server",
        allow_abbrev=False,
        formatter_class=formatter,
        description="Serve the completion, chat, Responses and Anthropic Messages routes by "
        "sending each request's prefill to a prefill server (pyxllm serve --kv-role prefill) "
        "and the request to a decode server (--kv-role decode) on the same --kv-offload-dir, "
        "streaming the decode server's answer back (docs/serving.md, Prefill/decode "
        "disaggregation).",
    )
    proxy.add_argument(
        "--prefill",
        action="append",
        required=True,
        metavar="URL",
        help="a prefill server's root, http://host:port (repeat it for several: they take turns)",
    )
    proxy.add_argument(
        "--decode",
        action="append",
        required=True,
        metavar="URL",
        help="a decode server's root, http://host:port (repeat it for several)",
    )
    proxy.add_argument(
        "--decode-kv-listen",
        action="append",
        metavar="HOST:PORT",
        help="the --kv-transfer-listen address of each --decode server, in their order, spelled "
        "as the prefill servers' --kv-transfer-push: each prefill request then names its decode "
        "server (kv_transfer_params), which alone gets its KV blocks (default: every "
        "--kv-transfer-push peer gets every block)",
    )
    proxy.add_argument("--host", default="127.0.0.1", help="the address to listen on")
    proxy.add_argument("--port", type=int, default=8000, help="the port to listen on")
    proxy.add_argument(
        "--timeout", type=float, default=600.0, help="seconds a request to a server may take"
    )
    return proxy


def check(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """URLs must be ``http(s)://...`` (``parser``'s usage error otherwise)."""
    for flag in ("prefill", "decode"):
        for url in getattr(args, flag):
            if not url.startswith(("http://", "https://")):
                parser.error(f"--{flag} {url!r}: must start with http:// or https://")
    if args.timeout <= 0:
        parser.error(f"--timeout: must be > 0, got {args.timeout}")
    if args.decode_kv_listen is not None:
        if len(args.decode_kv_listen) != len(args.decode):
            parser.error("--decode-kv-listen: give one for each --decode, in their order")
        for address in args.decode_kv_listen:
            try:
                parse_address(address, "--decode-kv-listen")
            except ValueError as exc:
                parser.error(str(exc))


def run(args: argparse.Namespace, config: EngineConfig) -> int:
    """Serve the proxy until interrupted; 0 when it stops."""
    # here, not at the top: pyxllm --help loads no fastapi
    from pyxllm.entrypoints.disagg_proxy import run_proxy

    run_proxy(args.prefill, args.decode, args.host, args.port, args.timeout, args.decode_kv_listen)
    return 0
