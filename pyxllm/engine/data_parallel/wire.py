"""The messages between the API server and a replica process, and the channel carrying them.

One connection per replica: the API server listens (:func:`listen`), the replica connects back
(:func:`connect`) wherever it was placed, so the same channel serves processes on this host and,
later, Ray actors on other nodes. The connection is ``multiprocessing.connection``'s, with an
HMAC challenge on a random key given to the replica at launch, so only a replica the server
started can talk to it; the messages below are pickled (they carry ``EngineRequest``\\s and
``RequestOutput``\\s, whose dataclasses and tensors JSON cannot hold), which is safe only
because the peer is authenticated first.

API server -> replica: :class:`AddMessage`, :class:`AbortMessage`, :class:`ScrapeMessage`,
:class:`StopMessage`. Replica -> API server: :class:`HelloMessage` (first, on connecting),
then :class:`ReadyMessage` or :class:`StartFailedMessage`, then :class:`OutputsMessage` (one per
engine step), :class:`FailedMessage`, :class:`ScrapeReply` and, before it exits on a fatal
error, :class:`DeadMessage`. A replica that dies closes the connection: end-of-file is how the
server learns of it, however it died; a peer whose node vanished (no FIN, no RST) is found
by TCP itself (:func:`keep_alive`).
"""

from __future__ import annotations

import os
import pickle
import socket
import threading
from dataclasses import dataclass, field
from multiprocessing.connection import Client, Connection, Listener

from pyxllm.engine.input_processor import EngineRequest
from pyxllm.outputs import PoolingRequestOutput, RequestOutput

# --- API server -> replica ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AddMessage:
    """Run ``request``, a plain value (the replica's engine compiles
    ``sampling_params.structured_outputs``; its prompt text and ids are there)."""

    request: EngineRequest


@dataclass(frozen=True, slots=True)
class AbortMessage:
    """Abort these requests and free their KV blocks (unknown ids are ignored)."""

    request_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class ScrapeMessage:
    """Answer with a :class:`ScrapeReply` carrying ``seq``."""

    seq: int


@dataclass(frozen=True, slots=True)
class StopMessage:
    """Stop the engine and exit with status 0."""


# --- replica -> API server ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class HelloMessage:
    """The first message of a replica: which one it is, and its process id."""

    replica: int
    pid: int


@dataclass(frozen=True, slots=True)
class ReadyMessage:
    """The model is loaded: the KV cache's size in blocks, and the CPUs and torch threads the
    replica computes with (``cpus`` empty: not pinned)."""

    num_kv_blocks: int
    threads: int
    cpus: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class StartFailedMessage:
    """Loading the engine failed; ``error`` is ``"<exception type>: <message>"``."""

    error: str


@dataclass(frozen=True, slots=True)
class OutputsMessage:
    """One engine step's outputs as deltas: each output's completions hold only the text,
    token ids and logprobs added since the request's previous output (the whole of them in
    its first); the prompt text and ids are left out (the server has them), and so are the
    prompt logprobs after the first output. The server appends them up again. A pooling
    request's one output (``PoolingRequestOutput``, its pooled vector) comes whole, less its
    prompt."""

    outputs: list[RequestOutput | PoolingRequestOutput]


@dataclass(frozen=True, slots=True)
class FailedMessage:
    """A request refused (``param`` set or ``invalid``: a 400) or failed in the engine
    (``constraint``: its structured-output constraint failed)."""

    request_id: str
    error: str
    invalid: bool = False
    param: str | None = None
    constraint: bool = False


@dataclass(frozen=True, slots=True)
class ScrapeReply:
    """The replica's ``LLMEngine.stats()`` and its Prometheus metrics in the text format."""

    seq: int
    stats: dict = field(default_factory=dict)
    metrics_text: str = ""


@dataclass(frozen=True, slots=True)
class DeadMessage:
    """The replica's engine can never serve again (why); it exits next."""

    error: str


# A connection idle this long is probed (seconds), this often, this many times unanswered
# before the kernel ends it; data sent but unacknowledged this long ends it too (ms). A peer
# whose node vanished is so found within ~15 s instead of never (idle) or ~15 min (Linux's
# retransmission limit).
KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_PROBES = 5, 2, 5
USER_TIMEOUT_MS = 15_000


def keep_alive(conn: Connection) -> None:
    """Turn on TCP keepalive probes and a user timeout on ``conn``'s socket (the options that
    exist on this OS), so that reading or writing to a peer that silently vanished fails
    (``OSError``: the channel's end) instead of blocking forever."""
    sock = socket.socket(fileno=os.dup(conn.fileno()))  # the same socket; closing the dup only
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for name, value in (
            ("TCP_KEEPIDLE", KEEPALIVE_IDLE_S),
            ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
            ("TCP_KEEPCNT", KEEPALIVE_PROBES),
            ("TCP_USER_TIMEOUT", USER_TIMEOUT_MS),
        ):
            if hasattr(socket, name):
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
    finally:
        sock.close()


class Channel:
    """One end of a replica connection: whole messages, sent from any thread.

    ``recv`` is for one reader thread; ``send`` may be called from several. The socket gets
    :func:`keep_alive`'s options.
    """

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self._send_lock = threading.Lock()
        keep_alive(conn)

    def send(self, message: object) -> None:
        """Send one message.

        Raises:
            OSError: the connection is closed (the peer died).
        """
        payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        with self._send_lock:
            self.conn.send_bytes(payload)

    def recv(self) -> object | None:
        """The next message, blocking; ``None`` once the peer is gone."""
        try:
            return pickle.loads(self.conn.recv_bytes())
        except (EOFError, OSError):
            return None

    def poll(self, timeout: float) -> bool:
        """Whether a message (or end-of-file) can be read within ``timeout`` seconds."""
        try:
            return self.conn.poll(timeout)
        except (EOFError, OSError):
            return True  # recv() will report the end

    def close(self) -> None:
        """Close the connection (the peer reads end-of-file); idempotent."""
        try:
            self.conn.close()
        except OSError:
            pass


def listen(host: str, authkey: bytes) -> Listener:
    """A listener on ``host`` (an ephemeral port) accepting replicas that know ``authkey``."""
    return Listener((host, 0), family="AF_INET", authkey=authkey)


def connect(address: tuple[str, int], authkey: bytes) -> Channel:
    """Connect a replica to the API server's listener at ``address``.

    Raises:
        OSError: the server cannot be reached; ``multiprocessing.AuthenticationError``: the key
            is wrong.
    """
    return Channel(Client(address, family="AF_INET", authkey=authkey))
