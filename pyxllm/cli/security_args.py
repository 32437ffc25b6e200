"""``pyxllm serve``'s security flags checked together, before the model loads: the API keys
(the flags, else ``$PYXLLM_API_KEY``) and the TLS files (see
:mod:`pyxllm.entrypoints.openai.middleware.security`)."""

from __future__ import annotations

import argparse
import os
import ssl

from pyxllm.entrypoints.flags import flag_names
from pyxllm.entrypoints.openai.server_options import API_KEY_ENV


def _no_password() -> bytes:
    raise ValueError("the key is encrypted; give an unencrypted one")


def check_security_args(args: argparse.Namespace, parser, environ=os.environ) -> None:
    """Resolve ``args.api_keys`` (the flags, else ``$PYXLLM_API_KEY``) and ``ssl_cert_reqs``,
    and check the TLS files load, all before the model does; a bad value is a usage error
    (``parser.error``, exit status 2)."""
    keys = [key for group in args.api_key or () for key in group]
    if not keys:
        keys = [key.strip() for key in environ.get(API_KEY_ENV, "").split(",") if key.strip()]
    args.api_keys = tuple(dict.fromkeys(keys))
    if args.protect_metrics and not args.api_keys:
        parser.error(f"--protect-metrics: needs --api-key (or ${API_KEY_ENV})")
    for name in ("ssl_keyfile", "ssl_certfile", "ssl_ca_certs"):
        path = getattr(args, name)
        if path is None:
            continue
        try:
            with open(path, "rb"):
                pass
        except OSError as exc:
            parser.error(f"{flag_names(name)[0]}: cannot read {path!r}: {exc.strerror or exc}")
    if not args.ssl_certfile:
        for name in ("ssl_keyfile", "ssl_ca_certs"):
            if getattr(args, name):
                parser.error(f"{flag_names(name)[0]}: needs --ssl-certfile")
    if args.ssl_cert_reqs is None:
        args.ssl_cert_reqs = ssl.CERT_REQUIRED if args.ssl_ca_certs else ssl.CERT_NONE
    elif args.ssl_cert_reqs and not args.ssl_ca_certs:
        parser.error("--ssl-cert-reqs: needs --ssl-ca-certs, the CAs of client certificates")
    if args.ssl_certfile:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        try:
            context.load_cert_chain(args.ssl_certfile, args.ssl_keyfile, password=_no_password)
        except (ssl.SSLError, ValueError) as exc:
            which = "--ssl-certfile" + (" and --ssl-keyfile" if args.ssl_keyfile else "")
            parser.error(f"{which}: not a PEM certificate and its private key: {exc}")
        if args.ssl_ca_certs:
            try:
                context.load_verify_locations(cafile=args.ssl_ca_certs)
            except (ssl.SSLError, ValueError) as exc:
                parser.error(f"--ssl-ca-certs: not PEM CA certificates: {exc}")
