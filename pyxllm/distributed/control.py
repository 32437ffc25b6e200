"""The control channel between TP rank 0 and the workers: one TCP connection per worker.

Rank 0 sends each step's plan (and the stop message) down every connection; a worker sends
nothing back except, when it fails, one error message before it exits. The connection doubles
as a liveness check in both directions, with no polling and no timeout while idle: a process
that dies, however it dies, has its sockets closed by the kernel, so

- rank 0 sees end-of-file on that worker's connection at once and knows which rank it was;
- a worker blocked waiting for the next plan sees end-of-file when rank 0 is gone, and exits.

Model tensors never travel here (they use torch.distributed's collectives). Rank 0 listens on an
ephemeral port of the master host and publishes it in the ranks' ``TCPStore`` under
``pyxllm/control``. Messages are compact JSON (lists, numbers, strings: nothing executable, so
a stray connection cannot run code on either end) behind an 8-byte little-endian length.
"""

from __future__ import annotations

import json
import select
import socket
import struct
import threading
import time
from collections.abc import Callable

_PORT_KEY = "pyxllm/control"
_HEADER = struct.Struct("<Q")

# Waits, in seconds (idle connections themselves have no time-out):
# rank 0's accept() wakes this often to check its deadline and that spawned workers still live
ACCEPT_POLL_S = 0.2
# the watcher's select() wakes this often to see that close() was called
WATCH_POLL_S = 0.2
# close() waits this long for the watcher thread to end
WATCHER_JOIN_S = 1.0


def encode(message: object) -> bytes:
    """One message as compact JSON bytes (tuples become lists)."""
    return json.dumps(message, separators=(",", ":")).encode()


def send_frame(sock: socket.socket, payload: bytes) -> None:
    """Send one length-prefixed frame."""
    sock.sendall(_HEADER.pack(len(payload)) + payload)


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    chunks, left = [], n
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def recv_frame(sock: socket.socket) -> bytes | None:
    """Receive one frame; ``None`` when the peer closed the connection (or reset it)."""
    try:
        header = _recv_exact(sock, _HEADER.size)
        return None if header is None else _recv_exact(sock, _HEADER.unpack(header)[0])
    except (ConnectionError, OSError):
        return None


def _hello_rank(frame: bytes | None, world_size: int) -> int | None:
    """The rank a worker's first frame announces (``{"rank": r}``), or ``None`` if it is not one."""
    try:
        rank = json.loads(frame)["rank"]
    except (TypeError, ValueError, KeyError):
        return None
    return rank if isinstance(rank, int) and 0 < rank < world_size else None


class ControlServer:
    """Rank 0's end: accepts one connection from each of ranks ``1..world_size-1``.

    Args:
        host: the master host (rank 0's address as the workers reach it).
        store: the ranks' ``TCPStore``; the listening port is published there.
        world_size: number of ranks, rank 0 included.
        timeout_s: how long to wait for every worker to connect.
        check_alive: called while waiting; raises when a spawned worker has died.
    Raises:
        TimeoutError: a worker did not connect in time (naming the missing ranks).
    """

    def __init__(
        self,
        host: str,
        store,
        world_size: int,
        timeout_s: float,
        check_alive: Callable[[], None] | None = None,
    ) -> None:
        self._listener = socket.create_server((host, 0))
        self._listener.settimeout(ACCEPT_POLL_S)
        store.set(_PORT_KEY, str(self._listener.getsockname()[1]))
        self.conns: dict[int, socket.socket] = {}
        self._lock = threading.Lock()
        self._closing = False
        self._watcher: threading.Thread | None = None
        deadline = time.monotonic() + timeout_s
        while len(self.conns) < world_size - 1:
            if check_alive is not None:
                check_alive()
            if time.monotonic() > deadline:
                missing = sorted(set(range(1, world_size)) - set(self.conns))
                raise TimeoutError(
                    f"ranks {missing} did not open the control connection within {timeout_s:g} s"
                )
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            conn.settimeout(timeout_s)
            rank = _hello_rank(recv_frame(conn), world_size)
            conn.settimeout(None)
            conn.setsockopt(
                socket.IPPROTO_TCP, socket.TCP_NODELAY, 1
            )  # a plan per step: no Nagle delay
            if rank is None or rank in self.conns:
                conn.close()  # not one of our workers
            else:
                self.conns[rank] = conn
        self._listener.close()

    def broadcast(self, message: object) -> None:
        """Send ``message`` to every worker.

        Raises:
            ConnectionError: a worker's connection is gone (naming its rank).
        """
        payload = encode(message)
        with self._lock:
            for rank, conn in self.conns.items():
                try:
                    send_frame(conn, payload)
                except OSError as e:
                    raise ConnectionError(f"worker rank {rank} is gone ({e})") from None

    def watch(self, on_failure: Callable[[int, str | None], None]) -> threading.Thread:
        """Start a daemon thread calling ``on_failure(rank, error text or None)`` once for each
        worker whose connection closes (or that reports an error) before :meth:`close`."""

        def run() -> None:
            live = dict(self.conns)
            while live and not self._closing:
                readable, _, _ = select.select(list(live.values()), [], [], WATCH_POLL_S)
                for conn in readable:
                    rank = next(r for r, c in live.items() if c is conn)
                    frame = recv_frame(conn)
                    del live[rank]
                    if not self._closing:
                        on_failure(rank, None if frame is None else frame.decode(errors="replace"))

        self._watcher = threading.Thread(target=run, name="pyxllm-tp-watch", daemon=True)
        self._watcher.start()
        return self._watcher

    def close(self, message: object | None = None) -> None:
        """Send ``message`` (e.g. the stop message) to the workers still connected, then close."""
        self._closing = True
        with self._lock:
            for conn in self.conns.values():
                try:
                    if message is not None:
                        send_frame(conn, encode(message))
                    conn.shutdown(socket.SHUT_WR)
                except OSError:
                    pass
        if self._watcher is not None:
            self._watcher.join(timeout=WATCHER_JOIN_S)
        for conn in self.conns.values():
            conn.close()


class ControlClient:
    """A worker's end: connects to rank 0's control port (found in the ``store``).

    Raises:
        OSError: rank 0's control port cannot be reached.
    """

    def __init__(self, host: str, store, rank: int, timeout_s: float) -> None:
        port = int(store.get(_PORT_KEY))
        self.sock = socket.create_connection((host, port), timeout=timeout_s)
        self.sock.settimeout(None)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        send_frame(self.sock, encode({"rank": rank}))

    def recv(self) -> object | None:
        """The next message from rank 0, blocking; ``None`` once rank 0 is gone."""
        frame = recv_frame(self.sock)
        return None if frame is None else json.loads(frame)

    def report_error(self, text: str) -> None:
        """Tell rank 0 why this worker is about to exit (best effort; plain UTF-8 text)."""
        try:
            send_frame(self.sock, text.encode())
        except OSError:
            pass

    def close(self) -> None:
        self.sock.close()
