"""The engine's side of the disk KV tier (``--kv-offload-dir``): which blocks go to the tier
and come back from it, and the counters ``/metrics`` and ``/debug/stats`` show.

:class:`KVTierConnector` is vLLM's KV connector idea kept small: before a step, the waiting
requests' leading full blocks that the RAM prefix cache lacks are looked up in the tier and read
into free blocks (``KVCacheManager.begin_tier_load``); after a step, the blocks the prefix cache
registered for it are written to the tier. ``--kv-role`` says which of the two an engine does:
``both`` (the default), ``prefill`` or ``decode``, the two instances of prefill/decode
disaggregation (:mod:`pyxllm.entrypoints.disagg_proxy`). A prefill instance reads and writes as
``both`` does, and also writes a prompt's blocks that it found in its RAM prefix cache but the
directory no longer holds (evicted, or deleted), so every full block of each prompt it computes
is on disk when its answer leaves. A decode instance reads only: its own blocks hold generated
tokens, which no other instance asks for.

Neither direction holds up a step. Reads: a waiting request whose next blocks are on disk
leaves the scheduler's queue while a reader thread reads and checks them into memory (free
blocks are set aside for them meanwhile); at the start of a later step they are copied into
those blocks and registered in the prefix cache, and the request goes back into the queue in
its arrival order, where its admission counts them as hits (vLLM's
``WAITING_FOR_REMOTE_KVS``). Writes: after a step, the new blocks' bytes are copied out of the
cache (a block may be reused by the next step), and a writer thread checksums and writes them
while the engine runs on. A prefill instance waits for its step's writes before its answers
leave (the decode instance reads them next), and any engine waits for them when it has nothing
left to run, so what it answered is on disk when it is idle or shut down.

Between engines that do not share a directory, ``--kv-transfer-push`` on the prefill instance
and ``--kv-transfer-listen`` on the decode instance (:mod:`pyxllm.engine.kv_transfer`) move the
same blocks over TCP: after each step, the full blocks of each scheduled request's prompt
computed so far (or found in a cache) are copied out and queued for the decode instances,
whose sender threads push them while the engine runs on; a finished request's answer is held
back (:meth:`KVTierConnector.hold`, at most ``HOLD_S`` seconds) until its blocks were pushed
or dropped, while later steps run.

Between engines on one Ray cluster, ``--kv-transfer-push ray://NAME`` and
``--kv-transfer-listen ray://NAME`` (:mod:`pyxllm.engine.kv_ray`) move them through the Ray
object store: the prefill instance's blocks go out as the TCP pushes do (and hold answers the
same way); the decode instance first asks the cluster's KV directory, on its reader thread,
which of a waiting request's prompt blocks it holds (the request leaves the queue meanwhile,
as for a read), then reads each block from its own directory or, failing that, from the
object store, writing what it fetched into its own directory.

Tokens count as vLLM's connector counts them: a request's first lookup adds its tokens to
``num_queries``; the tokens its blocks from the tier cover add to ``num_hits``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections.abc import Iterable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for_futures

from pyxllm.config import EngineConfig, ray_kv_directory
from pyxllm.distributed.ray_utils import connect_ray, disconnect_ray
from pyxllm.engine import kv_transfer
from pyxllm.engine.block_pool import KVBlock
from pyxllm.engine.kv_cache_manager import KVCacheManager, TierLoad
from pyxllm.engine.kv_offload import DiskKVTier
from pyxllm.engine.kv_ray import RayKVPusher, RayKVSource
from pyxllm.engine.kv_transfer import TOKEN_ENV, KVTransferClient, KVTransferServer, PushTicket
from pyxllm.engine.request import Request
from pyxllm.engine.scheduler import Scheduler

logger = logging.getLogger(__name__)

# --kv-role values: whether the engine reads the tier, and whether it writes it
KV_ROLES = {"both": (True, True), "prefill": (True, True), "decode": (True, False)}


class KVTierConnector:
    """Moves full KV blocks between an engine's cache and a :class:`DiskKVTier` (see the
    module doc).

    Args:
        tier: the directory's tier.
        kv: the engine's block manager.
        driver: the executor driver holding the cache (``read_kv_block`` / ``write_kv_block``).
        role: a :data:`KV_ROLES` key.
        transfer: the pusher to decode instances (``--kv-transfer-push``: over TCP, or into
            the Ray object store), or ``None``.
        listener: the decode instance's listener (``--kv-transfer-listen HOST:PORT``), or
            ``None``.
        remote: the decode instance's source of blocks in the Ray object store
            (``--kv-transfer-listen ray://NAME``), or ``None``; the connector closes all three.
        joined_ray: whether the connector joined the Ray cluster (and leaves it on close).

    Attributes:
        num_queries / num_hits: tokens looked up in the tier (each request once) and tokens
            read back from it.
        held: finished outputs waiting for their request's pushes, by request id: ``(output,
            ticket, deadline)`` (``time.monotonic()`` seconds).
        loading: the reads in flight, by request id: ``(its TierLoad, the reader's futures
            of the payloads)``, or, while the Ray directory is asked about a request,
            ``(the request, [the future of the answer])``.
    """

    def __init__(
        self,
        tier: DiskKVTier,
        kv: KVCacheManager,
        driver,
        role: str = "both",
        transfer: KVTransferClient | RayKVPusher | None = None,
        listener: KVTransferServer | None = None,
        remote: RayKVSource | None = None,
        joined_ray: bool = False,
    ) -> None:
        self.tier, self.kv, self.driver, self.role = tier, kv, driver, role
        self.transfer, self.listener, self.remote = transfer, listener, remote
        self.joined_ray = joined_ray
        # the refs the Ray directory holds for each request looked up there, by block hash
        self._found: weakref.WeakKeyDictionary[Request, dict] = weakref.WeakKeyDictionary()
        self.loads, self.saves = KV_ROLES[role]
        self.num_queries = self.num_hits = 0
        self._queried: weakref.WeakSet[Request] = weakref.WeakSet()
        self._missed: weakref.WeakSet[Request] = weakref.WeakSet()  # see _finish_loads
        # the reads (and Ray lookups) in flight, see the class doc
        self.loading: dict[str, tuple[TierLoad | Request, list[Future]]] = {}
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="pyxllm-kv-tier-read")
        # the writer thread's queue: futures of the writes in flight, and their blocks' hashes
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="pyxllm-kv-tier")
        self._pending: list[Future] = []
        self._writing: set[bytes] = set()
        self._lock = threading.Lock()
        # pushes: each request's prompt blocks queued so far, its ticket, and held answers
        self._pushed: weakref.WeakKeyDictionary[Request, int] = weakref.WeakKeyDictionary()
        self._tickets: dict[str, PushTicket] = {}
        self.held: dict[str, tuple[object, PushTicket, float]] = {}
        if self.saves:
            kv.pool.newly_cached = []  # the pool lists the blocks it registers

    @classmethod
    def from_config(cls, config: EngineConfig, front, executor, kv: KVCacheManager):
        """``--kv-offload-dir``'s connector (``None`` without the flag), its tier keyed by what
        the engine's KV bytes depend on.

        Raises:
            ValueError: the executor cannot read and write blocks (a worker process holds
                the cache).
        """
        if config.kv_offload_dir is None:
            return None
        driver = getattr(executor, "driver", None)
        if not hasattr(driver, "read_kv_block"):
            raise ValueError("--kv-offload-dir: needs the cache in this process (one rank)")
        block_bytes = len(driver.read_kv_block(0))
        path = str(front.source.path)
        # one file spelled two ways (a relative path, a link) is one model
        path = os.path.realpath(path) if os.path.exists(path) else path
        identity = "|".join(
            str(part)
            for part in (
                path,
                config.gguf_file,
                config.revision,
                driver.quantization,
                driver.dtype,
                config.kv_cache_dtype,
                config.block_size,
                type(driver.model).__name__,
                block_bytes,
            )
        )
        tier = DiskKVTier(
            config.kv_offload_dir, int(config.kv_offload_max_gib * 2**30), identity, block_bytes
        )
        logger.info(
            "KV tier on disk: %s (%.2f MB a block of %d tokens, at most %.1f GiB, role %s)",
            tier.root,
            block_bytes / 1e6,
            config.block_size,
            config.kv_offload_max_gib,
            config.kv_role,
        )
        transfer = listener = remote = None
        joined = False
        push = config.kv_transfer_push
        ray_push = ray_kv_directory(push[0]) if push else None
        ray_listen = ray_kv_directory(config.kv_transfer_listen)
        if ray_push or ray_listen:
            address = config.ray_address or os.environ.get("RAY_ADDRESS") or "auto"
            joined = connect_ray(address)
            max_bytes = int(config.kv_offload_max_gib * 2**30)
            if ray_push:
                transfer = RayKVPusher(ray_push, tier.root.name, max_bytes)
                logger.info("KV transfer: putting blocks into Ray KV directory %s", ray_push)
            if ray_listen:
                remote = RayKVSource(ray_listen, tier.root.name, block_bytes, max_bytes)
                logger.info("KV transfer: fetching blocks from Ray KV directory %s", ray_listen)
        token = os.environ.get(TOKEN_ENV) or None
        signed = f"with the secret of ${TOKEN_ENV}" if token else "without a secret"
        if config.kv_transfer_push and not ray_push:
            transfer = KVTransferClient(config.kv_transfer_push, tier.root.name, token)
            logger.info(
                "KV transfer: pushing blocks to %s, %s", ", ".join(config.kv_transfer_push), signed
            )
        if config.kv_transfer_listen is not None and not ray_listen:
            listener = KVTransferServer(tier, config.kv_transfer_listen, token)
            logger.info("KV transfer: receiving blocks on port %d, %s", listener.port, signed)
            if token is None:
                logger.warning(
                    "KV transfer: the listener takes pushes from anyone who reaches it: set "
                    "the same secret in $%s on both instances",
                    TOKEN_ENV,
                )
        return cls(tier, kv, driver, config.kv_role, transfer, listener, remote, joined)

    def load(self, scheduler: Scheduler) -> None:
        """Before scheduling: end the reads (and Ray lookups) that are done (their requests
        back into ``scheduler``'s queue), then start reading the waiting requests' prefix
        blocks that the tier (or the Ray directory) holds and the RAM prefix cache lacks (a
        request that asks for prompt logprobs computes its whole prompt). With a Ray source, a
        request is first looked up there, once, off this thread."""
        if not self.loads:
            return
        self._finish_loads(scheduler)
        started = []
        for request in scheduler.waiting:
            if request.num_computed_tokens or request.needs_prompt_logprobs:
                continue
            if request not in self._queried:
                self._queried.add(request)
                self.num_queries += request.num_tokens
            if self.role == "prefill":
                self._save_blocks(self.kv.get_computed_blocks(request))
            if request in self._missed:
                continue
            if self.remote is not None and request not in self._found:
                hashes = self.kv.tier_block_hashes(request)
                if hashes:
                    lookup = self._reader.submit(self.remote.lookup, hashes)
                    self.loading[request.request_id] = (request, [lookup])
                    started.append(request)
                    continue
            found = self._found.get(request) or {}

            def contains(block_hash: bytes, found: dict = found) -> bool:
                return block_hash in found or self.tier.contains(block_hash)

            load = self.kv.begin_tier_load(request, contains)
            if load is not None:
                run = [False]  # set at its first miss: the later blocks are not fetched
                reads = [self._reader.submit(self._read, h, found.get(h), run) for h in load.hashes]
                self.loading[request.request_id] = (load, reads)
                started.append(request)
        for request in started:
            scheduler.waiting.remove(request)

    def _finish_loads(self, scheduler: Scheduler) -> None:
        """Copy the finished reads into their blocks; their requests go back into the queue
        in arrival order. A request one of whose files failed is not looked up again (a file
        that cannot be read would otherwise keep it out of the queue)."""
        waiting = scheduler.waiting
        for request_id, (load, reads) in list(self.loading.items()):
            if not all(read.done() for read in reads):
                continue
            del self.loading[request_id]
            if isinstance(load, Request):  # a Ray lookup: its requests' reads start next
                self._found[load] = reads[0].result()
                later = (i for i, r in enumerate(waiting) if r.arrival_time > load.arrival_time)
                waiting.insert(next(later, len(waiting)), load)
                continue
            payloads = [read.result() for read in reads]
            loaded = self.kv.finish_tier_load(load, payloads, self.driver.write_kv_block)
            self.num_hits += loaded * self.kv.block_size
            request = load.request
            if loaded < len(payloads):
                self._missed.add(request)
            later = (i for i, r in enumerate(waiting) if r.arrival_time > request.arrival_time)
            waiting.insert(next(later, len(waiting)), request)

    def cancel(self, request: Request, scheduler: Scheduler) -> None:
        """``request`` ends (aborted): if its blocks are being read, drop the read and put it
        back in ``scheduler``'s queue, where the scheduler finishes it."""
        entry = self.loading.pop(request.request_id, None)
        if entry is not None:
            if not isinstance(entry[0], Request):
                self.kv.cancel_tier_load(entry[0])
            scheduler.waiting.appendleft(request)

    def _read(self, block_hash: bytes, ref, missed: list[bool]) -> bytes | None:
        """The reader thread's job: one block of a load from the tier, else (with ``ref``, the
        Ray directory's ref for it) from the object store, then written to the tier too. The
        load's blocks are read in order (one reader thread), and a run ends at its first miss:
        after one (``missed[0]``, set here), nothing more is read, since a prefix's blocks are
        used up to the first one missing (a damaged file's followers were read for nothing)."""
        if missed[0]:
            return None
        payload = self.tier.load(block_hash)
        if payload is None and ref is not None and self.remote is not None:
            payload = self.remote.fetch(ref)
            if payload is not None:
                self.tier.save(block_hash, payload)
        missed[0] = payload is None
        return payload

    def wait_for_loads(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for a read in flight, or a held answer's pushes, to
        end (an engine with nothing else to run does not spin)."""
        reads = [read for _, entry in self.loading.items() for read in entry[1]]
        if reads:
            wait_for_futures(reads, timeout, return_when=FIRST_COMPLETED)
        elif self.held:
            _, ticket, deadline = next(iter(self.held.values()))
            ticket.done.wait(max(0.0, min(timeout, deadline - time.monotonic())))

    def push(self, requests: Iterable[Request]) -> None:
        """After a step (``update_from_output``): queue for the ``--kv-transfer-push`` peers
        (the one a request's ``kv_transfer_params`` names, else all) the full prompt blocks of
        each of ``requests`` (the step's) computed so far and not queued before; returns at
        once (the sender threads push them)."""
        if self.transfer is None:
            return
        size, read = self.kv.block_size, self.driver.read_kv_block
        for request in requests:
            hashes, table = request.block_hashes, self.kv.tables.get(request.request_id)
            full = min(request.num_computed_tokens, request.num_prompt_tokens) // size
            end, start = min(full, len(hashes), len(table or ())), self._pushed.get(request, 0)
            if end <= start:
                continue
            self._pushed[request] = end
            ticket = self._tickets.setdefault(request.request_id, PushTicket())
            extra = request.sampling_params.extra_args or {}
            peers = self.transfer.peers_for(extra.get("kv_transfer_params"))
            for i in range(start, end):
                if self.transfer.wants(hashes[i], peers):
                    self.transfer.enqueue(hashes[i], read(table[i].block_id), ticket, peers)

    def hold(self, outputs: list) -> list:
        """A step's outputs to hand out now: ``outputs`` less the finished ones whose
        request's pushes are still in flight (held in :attr:`held`), then the held ones whose
        pushes ended or waited ``HOLD_S`` seconds, in the order they were held."""
        if self.transfer is None:
            return outputs
        now, ready = time.monotonic(), []
        for request_id, (output, ticket, deadline) in list(self.held.items()):
            if ticket.done.is_set() or now >= deadline:
                del self.held[request_id]
                ready.append(output)
        for output in outputs:
            ticket = self._tickets.pop(output.request_id, None) if output.finished else None
            if ticket is None or ticket.done.is_set():
                ready.append(output)
            else:
                self.held[output.request_id] = (output, ticket, now + kv_transfer.HOLD_S)
        return ready

    def drop(self, request_id: str) -> None:
        """``request_id`` was aborted: forget its ticket and its held answer."""
        self._tickets.pop(request_id, None)
        self.held.pop(request_id, None)

    def save(self) -> None:
        """After a step: the blocks the prefix cache registered for it, now computed, to the
        tier (in the background; a prefill instance waits for them)."""
        if not self.saves:
            return
        pool = self.kv.pool
        blocks, pool.newly_cached = pool.newly_cached, []
        self._save_blocks(blocks)
        if self.role == "prefill":
            self.flush()

    def _save_blocks(self, blocks: Iterable[KVBlock]) -> None:
        """Queue a write of each of ``blocks`` (computed, cached) that the tier lacks, its bytes
        copied now."""
        read = self.driver.read_kv_block
        for block in blocks:
            block_hash = block.block_hash
            if block_hash is None or block_hash in self._writing:
                continue
            if self.tier.contains(block_hash):
                continue
            with self._lock:
                self._writing.add(block_hash)
            future = self._writer.submit(self._write, block_hash, read(block.block_id))
            self._pending.append(future)

    def _write(self, block_hash: bytes, payload: bytes) -> None:
        """The writer thread's job: one block to the tier."""
        try:
            self.tier.save(block_hash, payload)
        finally:
            with self._lock:
                self._writing.discard(block_hash)

    def flush(self) -> None:
        """Wait until every queued write is on disk (or failed: a write that raised is logged)."""
        pending, self._pending = self._pending, []
        for future in wait_for_futures(pending).done:
            if future.exception() is not None:
                logger.error("KV tier: a write failed", exc_info=future.exception())

    def close(self) -> None:
        """Finish the queued writes, stop the writer thread, drop the pushes still queued and
        hand out nothing held; idempotent."""
        self.flush()
        self.held.clear()
        self._writer.shutdown(wait=True)
        self._reader.shutdown(wait=False, cancel_futures=True)
        if self.transfer is not None:
            self.transfer.close()
        if self.listener is not None:
            self.listener.close()
        if self.remote is not None:
            self.remote.close()
        if self.joined_ray:
            self.joined_ray = False
            disconnect_ray()

    def stats(self) -> dict[str, int]:
        """The counters under ``/debug/stats``' names."""
        tier = self.tier
        return {
            "kv_tier_queries": self.num_queries,
            "kv_tier_hit_tokens": self.num_hits,
            "kv_tier_hits": tier.hits,
            "kv_tier_bytes_read": tier.bytes_read,
            "kv_tier_blocks_written": tier.blocks_written,
            "kv_tier_bytes_written": tier.bytes_written,
            "kv_tier_rejected": tier.rejected,
            **{f"kv_transfer_{name}": count for name, count in self.transfer_counts().items()},
        }

    def transfer_counts(self) -> dict[str, int]:
        """Blocks by outcome over TCP or through Ray: ``pushed``, ``failed``, ``dropped``
        (with ``--kv-transfer-push``), ``received``, ``refused`` (with
        ``--kv-transfer-listen``; through Ray, ``failed`` also counts lookups and fetches that
        failed)."""
        counts = {}
        if self.transfer is not None:
            for name in ("pushed", "failed", "dropped"):
                counts[name] = getattr(self.transfer, name)
        for source in (self.listener, self.remote):
            if source is not None:
                counts.update(received=source.received, refused=source.refused)
        if self.remote is not None:
            counts["failed"] = counts.get("failed", 0) + self.remote.failed
        return counts
