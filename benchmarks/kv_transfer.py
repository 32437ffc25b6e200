"""How fast KV blocks move over TCP (``--kv-transfer-push`` to ``--kv-transfer-listen``) beside
writing them to a directory (``--kv-offload-dir``), on this host, in one run.

``--blocks`` random blocks of the embedded SmolLM2-135M's size in bfloat16 (30 layers, K and V,
3 KV heads of 64, 16 tokens: 0.37 MB) are, in turn: written to a temporary directory's tier
(``DiskKVTier.save``: checksum, temporary file, rename), and pushed over localhost to a
listener that writes them into another temporary directory (``KVTransferClient.push`` to
``KVTransferServer``: checksum on both sides, HTTP/1.1 on one kept-alive connection, the same
write). ``--rounds`` alternate the two, as the cores are shared. Printed for each: ms a block,
MB/s and tokens of KV a second. A prefill instance with ``--kv-transfer-push`` does both for
each new block (its own directory, then the push), on its writer thread. With ``--ray``, each
round also moves them through the Ray object store (``--kv-transfer-push ray://NAME``, a local
Ray instance started here, or the cluster at ``$RAY_ADDRESS``): ``Ray put`` is the prefill
side (``RayKVPusher``: ``ray.put`` and registration in a KV directory actor, batched, each
registered), ``Ray fetch`` the decode side (``RayKVSource``: one lookup, then each block's
``ray.get``, checks and write into a directory's tier); both in this process, where a fetch
reads the object store's shared memory as another process on the node would. Run from the
repository root::

    .venv/bin/python benchmarks/kv_transfer.py --blocks 200 --rounds 3 [--ray]

The local Ray instance of ``--ray`` writes a token into ``~/.ray/auth_token`` (Ray's token
authentication), which later Ray processes on the machine then read; prefix the command with
``RAY_AUTH_MODE=disabled`` to leave none behind (the figures in docs/serving.md ran so).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import tempfile
import time

from pyxllm.engine.kv_offload import DiskKVTier
from pyxllm.engine.kv_transfer import KVTransferClient, KVTransferServer

BLOCK_TOKENS = 16
# bytes of one block of the embedded model in bfloat16: layers x (K, V) x KV heads x head dim
BLOCK_BYTES = 30 * 2 * 3 * 64 * 2 * BLOCK_TOKENS


def timed_writes(payloads: list[bytes], hashes: list[bytes]) -> float:
    """Seconds to write ``payloads`` to a new directory's tier."""
    with tempfile.TemporaryDirectory() as directory:
        tier = DiskKVTier(directory, 2**40, "benchmark", BLOCK_BYTES)
        start = time.perf_counter()
        for block_hash, payload in zip(hashes, payloads):
            tier.save(block_hash, payload)
        return time.perf_counter() - start


def timed_pushes(payloads: list[bytes], hashes: list[bytes]) -> float:
    """Seconds to push ``payloads`` to a listener on localhost (each acknowledged)."""
    with tempfile.TemporaryDirectory() as directory:
        tier = DiskKVTier(directory, 2**40, "benchmark", BLOCK_BYTES)
        server = KVTransferServer(tier, "127.0.0.1:0")
        client = KVTransferClient([f"127.0.0.1:{server.port}"], tier.root.name)
        try:
            start = time.perf_counter()
            for block_hash, payload in zip(hashes, payloads):
                client.push(block_hash, payload)
            elapsed = time.perf_counter() - start
        finally:
            client.close()
            server.close()
        if server.received != len(payloads):
            raise RuntimeError(f"{server.received} of {len(payloads)} blocks arrived")
        return elapsed


def timed_ray(payloads: list[bytes], hashes: list[bytes]) -> tuple[float, float]:
    """Seconds to put ``payloads`` into the Ray object store and register them in a new KV
    directory (each registered), and seconds to look them up and fetch each into a new
    directory's tier; the directory actor is killed after."""
    import ray

    from pyxllm.engine.kv_ray import RayKVPusher, RayKVSource
    from pyxllm.engine.kv_transfer import PushTicket

    name = f"benchmark-{os.getpid()}-{time.monotonic_ns()}"
    with tempfile.TemporaryDirectory() as directory:
        tier = DiskKVTier(directory, 2**40, "benchmark", BLOCK_BYTES)
        pusher = RayKVPusher(name, tier.root.name, 2**40)
        source = RayKVSource(name, tier.root.name, BLOCK_BYTES, 2**40)
        try:
            ticket = PushTicket()
            start = time.perf_counter()
            for block_hash, payload in zip(hashes, payloads):
                pusher.enqueue(block_hash, payload, ticket)
            ticket.done.wait()
            put_s = time.perf_counter() - start
            start = time.perf_counter()
            found = source.lookup(hashes)
            for block_hash in hashes:
                tier.save(block_hash, source.fetch(found[block_hash]))
            fetch_s = time.perf_counter() - start
        finally:
            pusher.close()
            ray.kill(pusher.directory)
        if (pusher.pushed, source.received) != (len(payloads), len(payloads)):
            raise RuntimeError(f"{pusher.pushed} put, {source.received} fetched")
        return put_s, fetch_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=200, help="blocks a round moves")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each, alternated")
    parser.add_argument(
        "--ray", action="store_true", help="also time the Ray object store (needs Ray)"
    )
    args = parser.parse_args()
    if args.ray:
        import ray

        address = os.environ.get("RAY_ADDRESS")
        ray.init(address=address, num_cpus=None if address else 1, include_dashboard=False)
    runs = [("directory", timed_writes), ("TCP push", timed_pushes)]
    ray_times: dict[str, float] = {}

    def ray_put(payloads, hashes):
        ray_times["fetch"] = (times := timed_ray(payloads, hashes))[1]
        return times[0]

    if args.ray:
        runs += [("Ray put", ray_put), ("Ray fetch", lambda *_: ray_times["fetch"])]
    payloads = [os.urandom(BLOCK_BYTES) for _ in range(args.blocks)]
    hashes = [hashlib.sha256(str(i).encode()).digest() for i in range(args.blocks)]
    print(f"{args.blocks} blocks of {BLOCK_BYTES / 1e6:.2f} MB ({BLOCK_TOKENS} tokens) a round")
    for round_ in range(1, args.rounds + 1):
        for name, run in runs:
            seconds = run(payloads, hashes)
            print(
                f"round {round_} {name:>9}: {seconds / args.blocks * 1e3:5.2f} ms a block, "
                f"{args.blocks * BLOCK_BYTES / seconds / 1e6:5.0f} MB/s, "
                f"{args.blocks * BLOCK_TOKENS / seconds:6.0f} tokens/s"
            )


if __name__ == "__main__":
    main()
