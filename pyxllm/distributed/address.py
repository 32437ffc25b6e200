"""The master address every rank meets at (no torch import: the config checks it)."""

from __future__ import annotations


def parse_master_addr(text: str) -> tuple[str, int]:
    """``"host:port"`` (or ``"[v6]:port"``) -> ``(host, port)``.

    Raises:
        ValueError: no host, no port, or a port outside 1..65535 (naming ``--master-addr``).
    """
    host, sep, port = str(text).rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--master-addr: expected host:port (e.g. 127.0.0.1:19888), got {text!r}")
    return host, int(port)
