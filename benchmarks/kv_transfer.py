"""How fast KV blocks move over TCP (``--kv-transfer-push`` to ``--kv-transfer-listen``) beside
writing them to a directory (``--kv-offload-dir``), on this host, in one run.

``--blocks`` random blocks of the embedded SmolLM2-135M's size in bfloat16 (30 layers, K and V,
3 KV heads of 64, 16 tokens: 0.37 MB) are, in turn: written to a temporary directory's tier
(``DiskKVTier.save``: checksum, temporary file, rename), and pushed over localhost to a
listener that writes them into another temporary directory (``KVTransferClient.push`` to
``KVTransferServer``: checksum on both sides, HTTP/1.1 on one kept-alive connection, the same
write). ``--rounds`` alternate the two, as the cores are shared. Printed for each: ms a block,
MB/s and tokens of KV a second. A prefill instance with ``--kv-transfer-push`` does both for
each new block (its own directory, then the push), on its writer thread. Run from the
repository root::

    .venv/bin/python benchmarks/kv_transfer.py --blocks 200 --rounds 3
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=200, help="blocks a round moves")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each, alternated")
    args = parser.parse_args()
    payloads = [os.urandom(BLOCK_BYTES) for _ in range(args.blocks)]
    hashes = [hashlib.sha256(str(i).encode()).digest() for i in range(args.blocks)]
    print(f"{args.blocks} blocks of {BLOCK_BYTES / 1e6:.2f} MB ({BLOCK_TOKENS} tokens) a round")
    for round_ in range(1, args.rounds + 1):
        for name, run in (("directory", timed_writes), ("TCP push", timed_pushes)):
            seconds = run(payloads, hashes)
            print(
                f"round {round_} {name:>9}: {seconds / args.blocks * 1e3:5.2f} ms a block, "
                f"{args.blocks * BLOCK_BYTES / seconds / 1e6:5.0f} MB/s, "
                f"{args.blocks * BLOCK_TOKENS / seconds:6.0f} tokens/s"
            )


if __name__ == "__main__":
    main()
