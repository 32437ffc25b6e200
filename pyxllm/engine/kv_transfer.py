"""KV blocks moved over TCP between engines that do not share a ``--kv-offload-dir``.

Prefill/decode disaggregation on one host (or on a network filesystem) moves KV through the
shared directory. Between hosts, a decode instance listens with ``--kv-transfer-listen
HOST:PORT`` (:class:`KVTransferServer`) and a prefill instance pushes to it with
``--kv-transfer-push HOST:PORT`` (:class:`KVTransferClient`): every full block of each prompt
the prefill instance computes or finds in its caches goes, besides into its own directory, to
the decode instance, which writes it into its own directory; from there the decode instance
reads it back as it reads any tier block (:mod:`pyxllm.engine.kv_connector`). Pushes run on a
sender thread per peer, so no engine step waits on the network; a request's finished answer
waits (at most :data:`HOLD_S`) until its blocks were pushed and acknowledged, or dropped, so
the decode instance finds them when the proxy's decode request arrives (vLLM's P2P, Mooncake
and NIXL connectors push or pull the same blocks over NCCL or RDMA; this is the plain-socket
version). With several peers, a request whose ``kv_transfer_params`` (vLLM's request field)
names one of them (``remote_host``, ``remote_port``) pushes to that one only
(:meth:`KVTransferClient.peers_for`); other requests push to all.

The wire format is HTTP/1.1 on one kept-alive connection per peer: ``PUT /kv/<tier
digest>/<block hash, hex>`` with the block's payload as the body and its SHA-256 in
``X-Content-SHA256``; ``204`` when written. The receiver refuses (``409``) a block of another
tier digest (another model, dtype, block size or layout: see ``DiskKVTier``), and (``400``) a
body of the wrong length or checksum, so a foreign or torn transfer is never wrong KV. A push
that fails (peer down, refused, timed out) is logged and the peer skipped for
:data:`RETRY_AFTER` seconds; a block that comes meanwhile, or finds its peer's queue full
(:data:`MAX_QUEUED_BYTES`: a slow peer), is dropped; the decode instance then computes those
blocks itself.

Authentication: with a shared secret in :data:`TOKEN_ENV` on both instances, the secret never
travels: each push carries a timestamp (:data:`TIMESTAMP_HEADER`, Unix seconds) and an
HMAC-SHA256 keyed by the secret (:data:`SIGNATURE_HEADER`, hex; :func:`sign`) over what
identifies it: the method, the path (tier digest and block hash), the body's SHA-256 and the
timestamp. The listener computes the body's SHA-256 itself, recomputes the HMAC and compares
in constant time (``hmac.compare_digest``); it refuses (``401``, logged, the body never
stored) a push without a signature, with a wrong one, or with a timestamp more than
:data:`SIGNATURE_WINDOW_S` seconds from its own clock (keep the hosts' clocks in step, NTP).
A push recorded on the wire can be replayed within that window, but a signature covers one
block's path and bytes, so a replay only writes the same block again (a file already there is
left as it is). The secret is an environment variable, not a flag, so that it does not show in
the process list. Without it the listener takes any push (it warns at start). The connection
is plain HTTP either way: the signature keeps strangers from writing KV, not from reading the
blocks on the wire, so keep the link on a private network.
"""

from __future__ import annotations

import hashlib
import hmac
import http.client
import logging
import re
import threading
import time
from collections import OrderedDict, deque
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from pyxllm.engine.kv_offload import DiskKVTier

logger = logging.getLogger(__name__)

# the environment variable holding the shared secret of pushes and listeners
TOKEN_ENV = "PYXLLM_KV_TRANSFER_TOKEN"
# the headers of a signed push: its HMAC-SHA256 (hex) and its time (Unix seconds)
SIGNATURE_HEADER, TIMESTAMP_HEADER = "X-KV-Signature", "X-KV-Timestamp"
# seconds a signed push's timestamp may be off the listener's clock, either way
SIGNATURE_WINDOW_S = 60.0
# seconds a peer whose push failed is skipped
RETRY_AFTER = 5.0
# seconds a push may take (connect, send, acknowledge)
PUSH_TIMEOUT = 30.0
# bytes of payloads queued for one peer at most (more blocks are dropped)
MAX_QUEUED_BYTES = 256 * 2**20
# seconds a prefill instance's finished answer waits, at most, for its blocks' pushes
HOLD_S = 10.0
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


def sign(secret: bytes, method: str, path: str, body_sha256: str, timestamp: str) -> str:
    """The HMAC-SHA256 (RFC 2104, hex) keyed by ``secret`` over a push's method, path, the
    hex SHA-256 of its body and its timestamp, one line each: what :data:`SIGNATURE_HEADER`
    carries."""
    message = "\n".join((method, path, body_sha256, timestamp)).encode()
    return hmac.new(secret, message, hashlib.sha256).hexdigest()


class KVTransferServer:
    """A decode instance's listener: writes the blocks pushed to it into ``tier``.

    Args:
        tier: the instance's own directory tier (its ``root.name`` is the digest pushes must
            carry).
        address: ``HOST:PORT`` to listen on (port 0: any free port, see :attr:`port`).
        token: the shared secret a push must be signed with (``None``: any push is taken).

    Attributes:
        port: the port it listens on.
        received / refused: blocks written, pushes refused (no or a wrong signature, a stale
            timestamp, a wrong digest, length or checksum).

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
                length, headers = self.headers.get("Content-Length", ""), self.headers
                whole = length == str(tier.block_bytes)
                unsigned = server.unsigned(headers)
                if unsigned is not None:
                    if whole:  # drained, so the pusher reads the 401
                        self.rfile.read(tier.block_bytes)
                    status = server.refuse(401, self.client_address, unsigned)
                    self.close_connection = True
                elif not whole:  # not a block: its body is not read
                    status, self.close_connection = server.refuse(400), True
                else:
                    payload = self.rfile.read(tier.block_bytes)
                    sha = hashlib.sha256(payload).hexdigest()
                    if not server.signed("PUT", self.path, sha, headers):
                        status = server.refuse(401, self.client_address, "a wrong signature")
                    else:
                        checksum = headers.get("X-Content-SHA256")
                        status = server.receive(self.path, payload, checksum, sha)
                    self.close_connection = server.closed or status == 401
                self.send_response(status)
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

    def receive(
        self, path: str, payload: bytes, checksum: str | None, sha: str | None = None
    ) -> int:
        """Write one pushed block (``sha``: its payload's SHA-256, hex, if known): its HTTP
        status (204 written, 404 not a block's path, 409 another tier's digest, 400 a torn
        body, 503 closed)."""
        if self.closed:
            return 503
        match = _PATH.match(path)
        if match is None:
            return 404
        digest, block_hash = match.groups()
        if digest != self.tier.root.name:
            status = 409
        elif (
            len(payload) != self.tier.block_bytes
            or (sha or hashlib.sha256(payload).hexdigest()) != checksum
        ):
            status = 400
        else:
            with self._lock:
                self.tier.save(bytes.fromhex(block_hash), payload)
                self.received += 1
            return 204
        return self.refuse(status)

    def unsigned(self, headers) -> str | None:
        """Why a push's ``headers`` cannot carry a good signature (no signature or timestamp,
        or a timestamp more than :data:`SIGNATURE_WINDOW_S` seconds off this host's clock), or
        ``None`` (always, when the listener has no secret)."""
        if self._token is None:
            return None
        if not headers.get(SIGNATURE_HEADER) or not headers.get(TIMESTAMP_HEADER):
            return "no signature"
        try:
            skew = abs(time.time() - float(headers[TIMESTAMP_HEADER]))
        except ValueError:
            skew = float("nan")
        if not skew <= SIGNATURE_WINDOW_S:  # NaN too
            return f"a timestamp outside the {SIGNATURE_WINDOW_S:.0f} s window"
        return None

    def signed(self, method: str, path: str, body_sha256: str, headers) -> bool:
        """Whether ``headers``' signature is the listener's HMAC of the push (:func:`sign`),
        compared in constant time (always, when it has no secret)."""
        if self._token is None:
            return True
        expected = sign(self._token, method, path, body_sha256, headers[TIMESTAMP_HEADER])
        return hmac.compare_digest(headers[SIGNATURE_HEADER].encode(), expected.encode())

    def refuse(self, status: int, client: tuple | None = None, why: str = "") -> int:
        """Count and log a refused push (from ``client``, an address, and ``why``, when
        given); returns ``status``."""
        with self._lock:
            self.refused += 1
        reason = f" ({why})" if why else ""
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


class PushTicket:
    """What one request's answer waits for: its blocks queued for a peer and not yet
    acknowledged, refused, failed or dropped. Thread-safe.

    Attributes:
        done: set while no block of the request is in flight.
    """

    def __init__(self) -> None:
        self._left = 0
        self._lock = threading.Lock()
        self.done = threading.Event()
        self.done.set()

    def add(self) -> None:
        """One more block in flight."""
        with self._lock:
            self._left += 1
            self.done.clear()

    def finish(self) -> None:
        """One block's push ended (whatever its outcome)."""
        with self._lock:
            self._left -= 1
            if self._left <= 0:
                self.done.set()


class _Peer:
    """One listener a :class:`KVTransferClient` pushes to: its queue, its sender thread's
    connection, and what it acknowledged."""

    def __init__(self, host: str, port: int) -> None:
        self.address = (host, port)
        self.connection: http.client.HTTPConnection | None = None
        self.down_until = 0.0
        self.sent: OrderedDict[bytes, None] = OrderedDict()
        self.queue: deque[tuple[bytes, bytes, PushTicket | None]] = deque()
        self.queued_bytes = 0
        self.ready = threading.Condition()
        self.thread: threading.Thread | None = None


class KVTransferClient:
    """A prefill instance's pusher to its peers' :class:`KVTransferServer`.

    :meth:`enqueue` never blocks: each peer has a queue of at most :data:`MAX_QUEUED_BYTES`
    of payloads and a sender thread of its own, so a slow or dead peer delays nobody else and
    no engine step; a block that does not fit the queue, or comes while its peer is skipped
    after a failure, is dropped (:attr:`dropped`) and the decode instance computes it.
    :meth:`push` sends at once, on the caller's thread.

    Args:
        addresses: the peers, ``HOST:PORT`` each.
        digest: the instance's tier digest (``DiskKVTier.root.name``).
        token: the shared secret each push is signed with (``None``: pushes are unsigned).

    Attributes:
        pushed / failed / dropped: blocks acknowledged by a peer, pushes that failed (one per
            peer), and blocks never sent to a peer (its queue full, or it is skipped).

    Raises:
        ValueError: an address is not ``HOST:PORT``.
    """

    def __init__(
        self, addresses: tuple[str, ...] | list[str], digest: str, token: str | None = None
    ) -> None:
        self.peers = [_Peer(*parse_address(a, "--kv-transfer-push")) for a in addresses]
        self.digest = digest
        self._secret = None if token is None else token.encode()
        self.pushed = self.failed = self.dropped = 0
        self._counts = threading.Lock()
        self._unknown: set[tuple[str, int]] = set()
        self.closed = False

    def peers_for(self, params: dict | None) -> list[_Peer]:
        """The peers a request's blocks go to: the one its ``kv_transfer_params`` names
        (``remote_host`` and ``remote_port``, spelled as in ``--kv-transfer-push``), else all;
        all too, logged once, when it names none of them (a proxy's address that this
        instance does not push to)."""
        if not params or params.get("remote_host") is None:
            return self.peers
        address = (params["remote_host"].strip("[]"), params["remote_port"])
        for peer in self.peers:
            if peer.address == address:
                return [peer]
        if address not in self._unknown:
            self._unknown.add(address)
            logger.warning(
                "kv_transfer_params names %s:%s, not one of --kv-transfer-push's peers: "
                "pushing to all of them",
                *address,
            )
        return self.peers

    def wants(self, block_hash: bytes, peers: list[_Peer] | None = None) -> bool:
        """Whether one of ``peers`` (default: all) has not acknowledged ``block_hash`` yet
        (as far as it remembers)."""
        return any(block_hash not in peer.sent for peer in peers or self.peers)

    def enqueue(
        self,
        block_hash: bytes,
        payload: bytes,
        ticket: PushTicket | None = None,
        peers: list[_Peer] | None = None,
    ) -> None:
        """Queue one block for each of ``peers`` (default: all) that lacks it, ``ticket``
        counting it until its push ends; returns at once."""
        for peer in peers or self.peers:
            if block_hash in peer.sent:
                continue
            with peer.ready:
                skipped = time.monotonic() < peer.down_until
                if skipped or peer.queued_bytes + len(payload) > MAX_QUEUED_BYTES or self.closed:
                    self._count("dropped")
                    continue
                if peer.thread is None:
                    peer.thread = threading.Thread(
                        target=self._send_queued, args=(peer,), name="pyxllm-kv-push", daemon=True
                    )
                    peer.thread.start()
                if ticket is not None:
                    ticket.add()
                peer.queue.append((block_hash, payload, ticket))
                peer.queued_bytes += len(payload)
                peer.ready.notify()

    def _send_queued(self, peer: _Peer) -> None:
        """A peer's sender thread: pushes its queue in order until :meth:`close`."""
        while True:
            with peer.ready:
                while not peer.queue and not self.closed:
                    peer.ready.wait()
                if self.closed:
                    if peer.connection is not None:
                        peer.connection.close()
                    return
                block_hash, payload, ticket = peer.queue.popleft()
            try:
                if block_hash in peer.sent:
                    pass
                elif time.monotonic() < peer.down_until:
                    self._count("dropped")
                else:
                    self._send(peer, block_hash, payload)
            finally:
                with peer.ready:
                    peer.queued_bytes -= len(payload)
                if ticket is not None:
                    ticket.finish()

    def push(self, block_hash: bytes, payload: bytes) -> None:
        """Send one block to every peer that lacks it, now, on this thread; failures are
        logged and counted."""
        for peer in self.peers:
            if block_hash not in peer.sent and time.monotonic() >= peer.down_until:
                self._send(peer, block_hash, payload)

    def _send(self, peer: _Peer, block_hash: bytes, payload: bytes) -> None:
        """One block to ``peer`` (its connection opened if needed); a failure skips the peer
        for :data:`RETRY_AFTER` seconds."""
        sha, path = hashlib.sha256(payload).hexdigest(), f"/kv/{self.digest}/{block_hash.hex()}"
        headers = {"X-Content-SHA256": sha}
        if self._secret is not None:
            timestamp = str(int(time.time()))
            headers[TIMESTAMP_HEADER] = timestamp
            headers[SIGNATURE_HEADER] = sign(self._secret, "PUT", path, sha, timestamp)
        if peer.connection is None:
            peer.connection = http.client.HTTPConnection(*peer.address, timeout=PUSH_TIMEOUT)
        try:
            peer.connection.request("PUT", path, body=payload, headers=headers)
            response = peer.connection.getresponse()
            response.read()
            status = response.status
            if status != 204:  # a listener closes the connection after a refusal
                peer.connection.close()
                peer.connection = None
        except (OSError, http.client.HTTPException) as exc:
            peer.connection.close()
            peer.connection = None
            status = f"{type(exc).__name__}: {exc}"
        if status == 204:
            self._count("pushed")
            peer.sent[block_hash] = None
            if len(peer.sent) > MAX_REMEMBERED:
                peer.sent.popitem(last=False)
            return
        self._count("failed")
        if status == 401:
            status = (
                f"401: not signed with the listener's secret, or the clocks differ by over "
                f"{SIGNATURE_WINDOW_S:.0f} s; set the same ${TOKEN_ENV} on both"
            )
        peer.down_until = time.monotonic() + RETRY_AFTER
        logger.warning(
            "KV transfer to %s:%d failed (%s): skipped for %.0f s, the decode instance "
            "computes what it lacks",
            *peer.address,
            status,
            RETRY_AFTER,
        )

    def _count(self, name: str) -> None:
        with self._counts:
            setattr(self, name, getattr(self, name) + 1)

    def close(self) -> None:
        """Stop the sender threads (what is still queued is dropped; a push under way ends
        within :data:`PUSH_TIMEOUT`) and close the connections; idempotent."""
        self.closed = True
        for peer in self.peers:
            with peer.ready:
                left, peer.queue, peer.queued_bytes = peer.queue, deque(), 0
                peer.ready.notify_all()
            for _, _, ticket in left:
                self._count("dropped")
                if ticket is not None:
                    ticket.finish()
            if peer.thread is None and peer.connection is not None:
                peer.connection.close()
