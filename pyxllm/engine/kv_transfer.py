"""KV blocks moved over TCP between engines that do not share a ``--kv-offload-dir``.

Prefill/decode disaggregation on one host (or on a network filesystem) moves KV through the
shared directory. Between hosts, a decode instance listens with ``--kv-transfer-listen
HOST:PORT`` (:class:`KVTransferServer`) and a prefill instance pushes to it with
``--kv-transfer-push HOST:PORT`` (:class:`KVTransferClient`): every full block of each prompt
the prefill instance computes or finds in its caches goes, besides into its own directory, to
the decode instance, which writes it into its own directory; from there the decode instance
reads it back as it reads any tier block (:mod:`pyxllm.engine.kv_connector`). The prefill
instance's answer leaves only once its blocks were pushed and acknowledged, so the decode
instance finds them when the proxy's decode request arrives (vLLM's P2P, Mooncake and NIXL
connectors push or pull the same blocks over NCCL or RDMA; this is the plain-socket version).

The wire format is HTTP/1.1 on one kept-alive connection per peer: ``PUT /kv/<tier
digest>/<block hash, hex>`` with the block's payload as the body and its SHA-256 in
``X-Content-SHA256``; ``204`` when written. The receiver refuses (``409``) a block of another
tier digest (another model, dtype, block size or layout: see ``DiskKVTier``), and (``400``) a
body of the wrong length or checksum, so a foreign or torn transfer is never wrong KV. A push
that fails (peer down, refused, timed out) is logged and the peer skipped for
:data:`RETRY_AFTER` seconds; the decode instance then computes those blocks itself.

Authentication: with a shared secret in :data:`TOKEN_ENV` on both instances, each push carries
``Authorization: Bearer <secret>`` and the listener refuses (``401``, logged, the body never
stored) a push without it or with another (compared in constant time,
``hmac.compare_digest``). The secret is an environment variable, not a flag, so that it does
not show in the process list. Without it the listener takes any push (it warns at start). The
connection is plain HTTP either way: the secret keeps strangers from writing KV, not from
reading it on the wire, so keep the link on a private network.
"""

from __future__ import annotations

import hashlib
import hmac
import http.client
import logging
import re
import threading
import time
from collections import OrderedDict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from pyxllm.engine.kv_offload import DiskKVTier

logger = logging.getLogger(__name__)

# the environment variable holding the shared secret of pushes and listeners
TOKEN_ENV = "PYXLLM_KV_TRANSFER_TOKEN"
# seconds a peer whose push failed is skipped
RETRY_AFTER = 5.0
# seconds a push may take (connect, send, acknowledge)
PUSH_TIMEOUT = 30.0
# block hashes remembered as pushed to each peer (the older are pushed again if needed)
MAX_REMEMBERED = 1 << 16
_PATH = re.compile(r"^/kv/([0-9a-f]+)/([0-9a-f]+)$")


def parse_address(address: str, flag: str, lowest_port: int = 1) -> tuple[str, int]:
    """``HOST:PORT`` as ``(host, port)``.

    Raises:
        ValueError: not ``HOST:PORT`` with a port in ``lowest_port``..65535 (the message names
            ``flag``).
    """
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not lowest_port <= int(port) < 65536:
        raise ValueError(f"{flag} {address!r}: must be HOST:PORT")
    return host.strip("[]"), int(port)


class KVTransferServer:
    """A decode instance's listener: writes the blocks pushed to it into ``tier``.

    Args:
        tier: the instance's own directory tier (its ``root.name`` is the digest pushes must
            carry).
        address: ``HOST:PORT`` to listen on (port 0: any free port, see :attr:`port`).
        token: the shared secret a push must carry (``None``: any push is taken).

    Attributes:
        port: the port it listens on.
        received / refused: blocks written, pushes refused (no or a wrong secret, wrong
            digest, length or checksum).

    Raises:
        OSError: the address cannot be bound.
    """

    def __init__(self, tier: DiskKVTier, address: str, token: str | None = None) -> None:
        self.tier = tier
        self._token = None if token is None else token.encode()
        self.received = self.refused = 0
        self.closed = False
        self._lock = threading.Lock()  # one write at a time (pushes from several instances)
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_PUT(self) -> None:  # noqa: N802 (http.server's name)
                length = self.headers.get("Content-Length", "")
                if not server.authorized(self.headers.get("Authorization")):
                    if length == str(tier.block_bytes):  # drained, so the pusher reads the 401
                        self.rfile.read(tier.block_bytes)
                    status, self.close_connection = server.refuse(401, self.client_address), True
                elif length != str(tier.block_bytes):  # not a block: its body is not read
                    status, self.close_connection = server.refuse(400), True
                else:
                    payload = self.rfile.read(tier.block_bytes)
                    checksum = self.headers.get("X-Content-SHA256")
                    status = server.receive(self.path, payload, checksum)
                    self.close_connection = server.closed
                self.send_response(status)
                if status == 401:
                    self.send_header("WWW-Authenticate", "Bearer")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args) -> None:  # one line a block is too many
                pass

        self._http = ThreadingHTTPServer(
            parse_address(address, "--kv-transfer-listen", lowest_port=0), Handler
        )
        self._http.daemon_threads = True
        self.port = self._http.server_address[1]
        self._thread = threading.Thread(
            target=self._http.serve_forever, name="pyxllm-kv-transfer", daemon=True
        )
        self._thread.start()

    def receive(self, path: str, payload: bytes, checksum: str | None) -> int:
        """Write one pushed block: its HTTP status (204 written, 404 not a block's path, 409
        another tier's digest, 400 a torn body, 503 closed)."""
        if self.closed:
            return 503
        match = _PATH.match(path)
        if match is None:
            return 404
        digest, block_hash = match.groups()
        if digest != self.tier.root.name:
            status = 409
        elif (
            len(payload) != self.tier.block_bytes or hashlib.sha256(payload).hexdigest() != checksum
        ):
            status = 400
        else:
            with self._lock:
                self.tier.save(bytes.fromhex(block_hash), payload)
                self.received += 1
            return 204
        return self.refuse(status)

    def authorized(self, header: str | None) -> bool:
        """Whether an ``Authorization`` header value carries the listener's secret (always,
        when it has none)."""
        if self._token is None:
            return True
        scheme, _, secret = (header or "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(secret.encode(), self._token)

    def refuse(self, status: int, client: tuple | None = None) -> int:
        """Count and log a refused push (from ``client``, an address, when given); returns
        ``status``."""
        with self._lock:
            self.refused += 1
        reason = " (no or a wrong secret)" if status == 401 else ""
        origin = f" from {client[0]}:{client[1]}" if client else ""
        logger.warning("KV transfer: refused a block%s (HTTP %d%s)", origin, status, reason)
        return status

    def close(self) -> None:
        """Stop listening, and refuse what comes on connections still open; idempotent."""
        if self.closed:
            return
        self.closed = True
        self._http.shutdown()
        self._http.server_close()


class KVTransferClient:
    """A prefill instance's pusher to its peers' :class:`KVTransferServer`. Not thread-safe:
    one thread (the connector's writer) pushes.

    Args:
        addresses: the peers, ``HOST:PORT`` each.
        digest: the instance's tier digest (``DiskKVTier.root.name``).
        token: the shared secret sent with each push (``None``: none).

    Attributes:
        pushed / failed: blocks acknowledged by a peer, and pushes that failed (one per peer).

    Raises:
        ValueError: an address is not ``HOST:PORT``.
    """

    def __init__(
        self, addresses: tuple[str, ...] | list[str], digest: str, token: str | None = None
    ) -> None:
        self.peers = [parse_address(a, "--kv-transfer-push") for a in addresses]
        self.digest = digest
        self._auth = {} if token is None else {"Authorization": f"Bearer {token}"}
        self.pushed = self.failed = 0
        self._connections: dict[tuple[str, int], http.client.HTTPConnection] = {}
        self._down_until = {peer: 0.0 for peer in self.peers}
        self._sent = {peer: OrderedDict() for peer in self.peers}

    def wants(self, block_hash: bytes) -> bool:
        """Whether a peer has not acknowledged ``block_hash`` yet (as far as it remembers)."""
        return any(block_hash not in sent for sent in self._sent.values())

    def push(self, block_hash: bytes, payload: bytes) -> None:
        """Send one block to every peer that lacks it; failures are logged and counted."""
        headers = {"X-Content-SHA256": hashlib.sha256(payload).hexdigest(), **self._auth}
        path = f"/kv/{self.digest}/{block_hash.hex()}"
        for peer in self.peers:
            sent = self._sent[peer]
            if block_hash in sent or time.monotonic() < self._down_until[peer]:
                continue
            connection = self._connections.get(peer)
            if connection is None:
                connection = http.client.HTTPConnection(*peer, timeout=PUSH_TIMEOUT)
                self._connections[peer] = connection
            try:
                connection.request("PUT", path, body=payload, headers=headers)
                response = connection.getresponse()
                response.read()
                status = response.status
            except (OSError, http.client.HTTPException) as exc:
                connection.close()
                del self._connections[peer]
                status = f"{type(exc).__name__}: {exc}"
            if status == 204:
                self.pushed += 1
                sent[block_hash] = None
                if len(sent) > MAX_REMEMBERED:
                    sent.popitem(last=False)
                continue
            self.failed += 1
            self._down_until[peer] = time.monotonic() + RETRY_AFTER
            logger.warning(
                "KV transfer to %s:%d failed (%s): skipped for %.0f s, the decode instance "
                "computes what it lacks",
                *peer,
                status,
                RETRY_AFTER,
            )

    def close(self) -> None:
        """Close the connections."""
        for connection in self._connections.values():
            connection.close()
        self._connections.clear()
