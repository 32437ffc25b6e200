"""KV blocks moved through the Ray object store between engines on one Ray cluster.

The third way (beside a shared ``--kv-offload-dir`` and TCP, :mod:`pyxllm.engine.kv_transfer`)
for a prefill instance's KV to reach a decode instance, for instances that joined the same Ray
cluster: as plain processes (``--ray-address``, else ``$RAY_ADDRESS``, else the cluster ``ray
start`` started on this node) or as Ray actors (data-parallel replicas placed by Ray), which
are in the cluster already.

The flags are the TCP ones with a ``ray://NAME`` address: ``--kv-transfer-push ray://NAME`` on
the prefill instance and ``--kv-transfer-listen ray://NAME`` on the decode instance. They
read as what each side does (the prefill instance sends its blocks somewhere, the decode
instance takes blocks from somewhere), keep ``--kv-role``'s checks (a decode instance pushes
nothing), and ``NAME`` says which KV directory of the cluster to use, so several
prefill/decode set-ups can share a cluster; a separate ``--kv-transfer ray`` switch would
have needed its own name for that, and rules for how it combines with the addresses.

- The prefill instance (:class:`RayKVPusher`), on a sender thread, ``ray.put``s each full
  block of each prompt it computes or finds in its caches as ``(tier digest, SHA-256, payload)``
  (the payload the TCP path sends, the digest of what its bytes mean: model, dtypes, block
  size, layout) and registers the ``ObjectRef`` in the cluster's KV directory: a small named,
  detached actor (:class:`KVDirectory`, ``pyxllm-kv-NAME`` in Ray namespace ``pyxllm``, made
  by whichever instance comes first) that maps ``(tier digest, block hash)`` to the ref. As
  over TCP, a finished request's answer is held (at most ``HOLD_S``) until its blocks are
  registered, so the decode instance finds them when the proxy's decode request arrives.
- The decode instance (:class:`RayKVSource`), for a waiting request, asks the directory (on
  its reader thread, not the engine's) which of the request's prompt blocks it holds, then
  ``ray.get``s those its own directory lacks, checks the digest, the length and the SHA-256,
  writes them into its own directory and loads them as tier hits. A block the directory does
  not hold, a ref whose object is gone (its prefill instance left the cluster), a fetch that
  fails or times out (:data:`FETCH_TIMEOUT_S`), a payload of another tier's digest or a torn
  one: each is a miss, and the decode instance computes that block and the rest of the prompt.

The directory holds refs, the object store the bytes: the directory keeps at most
``max_bytes`` of payloads (the ``--kv-offload-max-gib`` of the instance that made it),
least recently registered or looked up first out; a ref it drops frees its object (Ray's
reference counting). The objects belong to the prefill instance that put them (Ray's
ownership): they live while it stays in the cluster (but for objects under Ray's inline
limit, 100 KB by default, which travel inside their refs and so outlive it). Ray moves them
between nodes itself (its object manager, over its own connections), so this pays over TCP
when the instances run on Ray anyway: no listener port to open, one address (the cluster's)
to configure. Ray's own authentication guards the cluster; ``PYXLLM_KV_TRANSFER_TOKEN`` plays
no part here.

Ray is optional (``.venv/bin/pip install 'pyxllm[ray]'``): imported only when a ``ray://``
address is given.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import OrderedDict, deque

from pyxllm.distributed.ray_utils import import_ray
from pyxllm.engine import kv_transfer  # its limits (queued bytes, remembered blocks) are ours

logger = logging.getLogger(__name__)

# the Ray namespace of the KV directories, and their actors' name before the directory's
NAMESPACE, ACTOR_PREFIX = "pyxllm", "pyxllm-kv-"
# seconds a decode instance waits for the directory's answer, or for one block's bytes
FETCH_TIMEOUT_S = 10.0
# seconds a prefill instance waits for the directory to register a batch of blocks
REGISTER_TIMEOUT_S = 30.0
# blocks registered in one call to the directory, at most
BATCH = 64


class KVDirectory:
    """The KV directory of a Ray cluster, run as a named, detached actor: ``(tier digest,
    block hash)`` -> the ``ObjectRef`` of the block's ``(digest, SHA-256, payload)``, least
    recently used first out beyond ``max_bytes`` of payloads.

    Refs travel wrapped in a one-element list, so that Ray passes the ref rather than its
    value.

    Args:
        max_bytes: the most payload bytes whose refs it holds.

    Attributes:
        nbytes: payload bytes of the refs held; evicted: refs dropped for room, since start.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.entries: OrderedDict[tuple[str, bytes], tuple[list, int]] = OrderedDict()
        self.nbytes = self.evicted = 0

    def register(self, digest: str, blocks: list[tuple[bytes, int, list]]) -> int:
        """Hold each ``(block hash, payload bytes, [ref])`` of ``blocks`` (one registered
        again replaces its entry), then drop the least recently used beyond ``max_bytes``;
        returns how many it holds now."""
        for block_hash, nbytes, ref in blocks:
            old = self.entries.pop((digest, block_hash), None)
            if old is not None:
                self.nbytes -= old[1]
            self.entries[(digest, block_hash)] = (ref, nbytes)
            self.nbytes += nbytes
        self.resize(self.max_bytes)
        return len(self.entries)

    def lookup(self, digest: str, hashes: list[bytes]) -> list[list | None]:
        """For each of ``hashes``: ``[ref]`` when held (now the most recently used), else
        ``None``."""
        found = []
        for block_hash in hashes:
            entry = self.entries.get((digest, block_hash))
            if entry is not None:
                self.entries.move_to_end((digest, block_hash))
            found.append(None if entry is None else entry[0])
        return found

    def resize(self, max_bytes: int) -> int:
        """Hold at most ``max_bytes`` of payloads from now on, dropping the least recently used
        refs beyond; returns how many it dropped."""
        self.max_bytes, dropped = max_bytes, 0
        while self.entries and self.nbytes > self.max_bytes:
            _, (_, nbytes) = self.entries.popitem(last=False)
            self.nbytes -= nbytes
            dropped += 1
        self.evicted += dropped
        return dropped

    def stats(self) -> dict[str, int]:
        """``blocks`` and ``bytes`` held, ``max_bytes``, ``evicted`` since start."""
        return {
            "blocks": len(self.entries),
            "bytes": self.nbytes,
            "max_bytes": self.max_bytes,
            "evicted": self.evicted,
        }


def kv_directory(name: str, max_bytes: int):
    """The handle of the cluster's KV directory ``name``, started (detached, no CPU, holding
    at most ``max_bytes``) if no instance has started it yet. Needs ``ray.init`` done."""
    ray = import_ray()
    actor = ray.remote(num_cpus=0)(KVDirectory)
    return actor.options(
        name=ACTOR_PREFIX + name, namespace=NAMESPACE, lifetime="detached", get_if_exists=True
    ).remote(max_bytes)


def pack(digest: str, payload: bytes) -> tuple[str, str, bytes]:
    """What goes into the object store for a block: ``(tier digest, SHA-256 of the payload
    in hex, payload)``."""
    return digest, hashlib.sha256(payload).hexdigest(), payload


class RayKVPusher:
    """A prefill instance's sender of blocks into the object store and the KV directory
    ``name`` (see the module doc); its methods are :class:`~pyxllm.engine.kv_transfer.
    KVTransferClient`'s, so the connector pushes through either.

    :meth:`enqueue` never blocks: a sender thread puts the queued blocks and registers them
    in batches; a block that would take the queue past ``MAX_QUEUED_BYTES`` is dropped.

    Args:
        name: the directory's name (``ray://NAME``).
        digest: the instance's tier digest.
        max_bytes: the directory's bound, if this instance starts it.

    Attributes:
        pushed / failed / dropped: blocks registered, blocks whose put or registration
            failed, blocks never sent (queue full).
    """

    def __init__(self, name: str, digest: str, max_bytes: int) -> None:
        self.name, self.digest = name, digest
        self.directory = kv_directory(name, max_bytes)
        self.pushed = self.failed = self.dropped = 0
        self.sent: OrderedDict[bytes, None] = OrderedDict()
        self.queue: deque = deque()
        self.queued_bytes = 0
        self.ready = threading.Condition()
        self.closed = False
        self.thread = threading.Thread(target=self._send_queued, name="pyxllm-kv-ray", daemon=True)
        self.thread.start()

    def peers_for(self, params: dict | None) -> None:
        """Every decode instance takes what it needs from the directory: a request's
        ``kv_transfer_params`` changes nothing here."""
        return None

    def wants(self, block_hash: bytes, peers=None) -> bool:
        """Whether ``block_hash`` was not registered yet (as far as this instance remembers)."""
        return block_hash not in self.sent

    def enqueue(self, block_hash: bytes, payload: bytes, ticket=None, peers=None) -> None:
        """Queue one block, ``ticket`` counting it until it is registered or failed; returns
        at once."""
        with self.ready:
            if self.closed or self.queued_bytes + len(payload) > kv_transfer.MAX_QUEUED_BYTES:
                self.dropped += 1
                return
            if ticket is not None:
                ticket.add()
            self.queue.append((block_hash, payload, ticket))
            self.queued_bytes += len(payload)
            self.ready.notify()

    def _send_queued(self) -> None:
        """The sender thread: puts and registers the queue, :data:`BATCH` blocks a call, until
        :meth:`close`."""
        while True:
            with self.ready:
                while not self.queue and not self.closed:
                    self.ready.wait()
                if self.closed:
                    return
                batch = [self.queue.popleft() for _ in range(min(BATCH, len(self.queue)))]
            try:
                self._register([(h, p) for h, p, _ in batch if h not in self.sent])
            finally:
                with self.ready:
                    self.queued_bytes -= sum(len(p) for _, p, _ in batch)
                for _, _, ticket in batch:
                    if ticket is not None:
                        ticket.finish()

    def _register(self, blocks: list[tuple[bytes, bytes]]) -> None:
        """Put ``blocks`` (``(hash, payload)``) into the object store and register them; a
        failure is logged and counted."""
        if not blocks:
            return
        ray = import_ray()
        try:
            entries = [(h, len(p), [ray.put(pack(self.digest, p))]) for h, p in blocks]
            ray.get(
                self.directory.register.remote(self.digest, entries), timeout=REGISTER_TIMEOUT_S
            )
        except Exception as exc:  # noqa: BLE001 - any failure of Ray's is a miss downstream
            self.failed += len(blocks)
            logger.warning(
                "KV transfer to Ray directory %s failed (%s: %s): the decode instance "
                "computes what it lacks",
                self.name,
                type(exc).__name__,
                exc,
            )
            return
        self.pushed += len(blocks)
        for block_hash, _ in blocks:
            self.sent[block_hash] = None
            if len(self.sent) > kv_transfer.MAX_REMEMBERED:
                self.sent.popitem(last=False)

    def close(self) -> None:
        """Stop the sender thread (what is still queued is dropped); idempotent."""
        with self.ready:
            self.closed = True
            left, self.queue, self.queued_bytes = self.queue, deque(), 0
            self.ready.notify_all()
        for _, _, ticket in left:
            self.dropped += 1
            if ticket is not None:
                ticket.finish()


class RayKVSource:
    """A decode instance's reader of blocks from the KV directory ``name`` (see the module
    doc). Its calls wait on Ray: make them on a thread of their own.

    Args:
        name: the directory's name (``ray://NAME``).
        digest: the instance's tier digest; block_bytes: one block's payload, bytes.
        max_bytes: the directory's bound, if this instance starts it.

    Attributes:
        received: blocks fetched and checked; refused: payloads of another digest, length
            or checksum; failed: lookups and fetches that failed (a ref whose object is gone,
            a timeout).
    """

    def __init__(self, name: str, digest: str, block_bytes: int, max_bytes: int) -> None:
        self.name, self.digest, self.block_bytes = name, digest, block_bytes
        self.directory = kv_directory(name, max_bytes)
        self.received = self.refused = self.failed = 0
        self._warned_at = 0.0

    def lookup(self, hashes: list[bytes]) -> dict[bytes, object]:
        """The refs the directory holds for ``hashes``, by hash (empty when it cannot be
        asked)."""
        if not hashes:
            return {}
        ray = import_ray()
        try:
            found = ray.get(
                self.directory.lookup.remote(self.digest, list(hashes)), timeout=FETCH_TIMEOUT_S
            )
        except Exception as exc:  # noqa: BLE001 - a directory that cannot be asked is a miss
            self._fail("lookup", exc)
            return {}
        return {h: ref[0] for h, ref in zip(hashes, found) if ref is not None}

    def fetch(self, ref) -> bytes | None:
        """The payload of a block's ``ref`` when it is whole and of this instance's digest,
        else ``None`` (counted)."""
        ray = import_ray()
        try:
            packed = ray.get(ref, timeout=FETCH_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - a lost object, a timeout: a miss
            self._fail("fetch", exc)
            return None
        try:
            digest, checksum, payload = packed
            whole = (
                digest == self.digest
                and isinstance(payload, bytes)
                and len(payload) == self.block_bytes
                and hashlib.sha256(payload).hexdigest() == checksum
            )
        except (TypeError, ValueError):
            whole = False
        if not whole:
            self.refused += 1
            logger.warning(
                "KV transfer: a block from Ray directory %s is of another model or torn: "
                "computed instead",
                self.name,
            )
            return None
        self.received += 1
        return payload

    def _fail(self, what: str, exc: BaseException) -> None:
        """Count a failed call; log it at most every 5 seconds."""
        self.failed += 1
        now = time.monotonic()
        if now - self._warned_at >= 5.0:
            self._warned_at = now
            logger.warning(
                "KV transfer: %s in Ray directory %s failed (%s: %s): computing instead",
                what,
                self.name,
                type(exc).__name__,
                str(exc).splitlines()[0] if str(exc) else "",
            )

    def close(self) -> None:
        """Nothing to stop (the directory outlives the instance)."""
