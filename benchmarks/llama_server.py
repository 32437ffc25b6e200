"""compare.py's llama-server sections: pyxllm against llama.cpp's own server and llama-bench.

- ``llama-server``: ``pyxllm serve`` with no flags (the GGUF's weights as stored, the graph
  runner), ``pyxllm serve --quantization w8a8 --graph-backend graph`` and ``llama-server
  -np N -cb -t THREADS`` (N slots: the most clients of any workload, each slot with room for the
  longest prompt and its completion) on the same GGUF, one after the other, each driven by
  ``pyxllm bench serve``'s client. For each workload (``--llama-server-workloads``: prompt
  tokens x clients, by default 100 x 8, 100 x 32 and 1000 x 8; ``--output-len`` new tokens,
  ``ignore_eos``; ``--requests-per-client`` random prompts per client, the same texts for both
  servers): aggregate output tok/s, median TTFT and median TPOT. A warm-up load of other
  prompts goes first, so no timed prompt is in either server's prefix or slot cache.
- ``long-context``: batch 1 at ``--long-context`` (4096) tokens of context. llama-bench
  ``pp4096`` (the prefill of 4096 tokens) and ``tg128 @ d4096`` (128 tokens decoded after 4096
  in the cache), ``--long-context-reps`` repetitions each, against pyxllm with ``--quantization
  int4`` (the GGUF's Q4_1 weights, which llama.cpp runs) and the graph runner on as many fresh
  prompts of 4096 tokens: the time to the first token is the prefill, the rate of the tokens
  after it the decode at that depth.

The binaries come from ``benchmarks/build_llama_server.sh`` (``--llama-server-dir``); without
them both sections are skipped with a message.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from harness import GRAPH_BACKEND, log, measure_server, pyxllm_serve_cmd, ratio_lines

from pyxllm.benchmarks.prompts import make_prompts
from pyxllm.kernels.cpu.features import cpu_flags
from pyxllm.weights.source import default_gguf_path

# the llama-cpp-python release whose vendored llama.cpp build_llama_server.sh builds
LLAMA_CPP_PYTHON_VERSION = "0.3.36"
DEFAULT_BIN_DIR = (
    Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    / "pyxllm"
    / f"llama.cpp-{LLAMA_CPP_PYTHON_VERSION}"
    / "bin"
)
DEFAULT_WORKLOADS = "100x8,100x32,1000x8"
# tokens of room beyond a prompt and its completion (a server may count a few more tokens)
CONTEXT_MARGIN = 64
# pyxllm's KV cache budget in the llama-server section, GiB
KV_CACHE_GIB = 1.0
# CPU flags of the int8 dot products that --quantization w8a8's GEMMs need to be fast
INT8_DOT_FLAGS = frozenset({"avx512_vnni", "avx_vnni", "amx_int8"})


def find_binaries(
    bin_dir: str | Path,
    names=("llama-server", "llama-bench"),
    skipped: str = "llama-server and long-context",
) -> dict[str, Path] | None:
    """``{name: path}`` of llama.cpp's ``names`` in ``bin_dir``, or None (with a message saying
    how to build them and that the ``skipped`` sections are skipped) when any is missing."""
    found = {name: Path(bin_dir) / name for name in names}
    missing = [name for name, path in found.items() if not os.access(path, os.X_OK)]
    if not missing:
        return found
    log(
        f"{' and '.join(missing)} not built in {bin_dir} (run benchmarks/build_llama_server.sh, "
        f"a build of minutes, or pass --llama-server-dir): {skipped} skipped"
    )
    return None


def parse_workloads(text: str) -> list[tuple[int, int]]:
    """``"100x8,1000x8"`` -> ``[(100, 8), (1000, 8)]`` (prompt tokens, clients).

    Raises:
        ValueError: naming ``--llama-server-workloads``, for anything else.
    """
    workloads = []
    for item in filter(None, text.split(",")):
        tokens, _, clients = item.partition("x")
        if not (tokens.isdigit() and clients.isdigit() and int(tokens) > 0 and int(clients) > 0):
            raise ValueError(
                f"--llama-server-workloads: {item!r} is not PROMPT_TOKENSxCLIENTS (e.g. 100x8)"
            )
        workloads.append((int(tokens), int(clients)))
    if not workloads:
        raise ValueError("--llama-server-workloads: give at least one, e.g. 100x8")
    return workloads


def workload_label(input_len: int, clients: int) -> str:
    """The key of a workload's figures: ``"100x8"``."""
    return f"{input_len}x{clients}"


def serving(
    binary: Path,
    tokenizer,
    workloads: list[tuple[int, int]],
    output_len: int,
    requests_per_client: int,
    threads: int,
    model: Path | None = None,
) -> dict[str, dict[str, dict]]:
    """The ``llama-server`` section: ``{workload label: {"pyxllm": figures, "llama-server":
    figures}}``, each server started once for all the workloads, on ``model`` (a GGUF file;
    default: the embedded model's)."""
    model = model or default_gguf_path()
    loads = {
        workload_label(n, c): (
            make_prompts(tokenizer, c * requests_per_client, n, "random", seed=1000 + i),
            output_len,
            c,
        )
        for i, (n, c) in enumerate(workloads)
    }
    warmup = make_prompts(tokenizer, 2, 32, "random", seed=999)
    slot_len = max(n for n, _ in workloads) + output_len + CONTEXT_MARGIN
    slots = max(c for _, c in workloads)
    sizing = ["--model", str(model)] + (
        f"--max-model-len {slot_len} --kv-cache-memory {KV_CACHE_GIB} "
        f"--max-seqs-per-batch {max(64, slots)}".split()
    )
    servers = {
        # the defaults: the GGUF's weights as stored, the graph runner
        "pyxllm": (18933, pyxllm_serve_cmd(18933, *sizing)),
    }
    if INT8_DOT_FLAGS & cpu_flags():  # w8a8 has no fast kernel without them (docs/performance.md)
        servers["pyxllm w8a8"] = (
            18935,
            pyxllm_serve_cmd(
                18935, "--quantization", "w8a8", "--graph-backend", GRAPH_BACKEND, *sizing
            ),
        )
    else:
        log("pyxllm w8a8: skipped (no int8 dot-product instructions on this CPU)")
    servers |= {
        "llama-server": (
            18934,
            [str(binary), "-m", str(model)]
            + f"--host 127.0.0.1 --port 18934 -np {slots} -cb -t {threads} "
            f"-c {slots * slot_len}".split(),
        ),
    }
    results: dict[str, dict[str, dict]] = {label: {} for label in loads}
    for name, (port, cmd) in servers.items():
        for label, figures in measure_server(name, cmd, port, threads, loads, warmup).items():
            results[label][name] = figures
            log(f"{name} {label}:", json.dumps(figures))
    return results


def llama_bench(
    binary: Path, context: int, output_len: int, reps: int, threads: int
) -> dict[str, float]:
    """llama-bench on the default GGUF: ``pp{context}`` and ``tg{output_len} @ d{context}``
    (mean tok/s over ``reps`` repetitions, after llama-bench's own warm-up run).

    Raises:
        RuntimeError: llama-bench failed (its output's tail in the message).
    """
    figures = {}
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    for key, test in (
        ("prefill_tok_s", ("-p", str(context), "-n", "0")),
        ("decode_tok_s", ("-p", "0", "-n", str(output_len), "-d", str(context))),
    ):
        cmd = [str(binary), "-m", str(default_gguf_path()), "-t", str(threads), "-r", str(reps)]
        done = subprocess.run(
            [*cmd, *test, "-o", "json"], env=env, capture_output=True, text=True, check=False
        )
        if done.returncode != 0:
            raise RuntimeError(
                f"llama-bench {' '.join(test)} exited with status {done.returncode}: "
                f"{(done.stderr or done.stdout)[-2000:]}"
            )
        (row,) = json.loads(done.stdout)
        figures[key] = row["avg_ts"]
        figures[key.replace("_tok_s", "_stddev")] = row["stddev_ts"]
    return figures


def pyxllm_long_context(tokenizer, context: int, output_len: int, reps: int) -> dict[str, float]:
    """pyxllm's batch-1 figures at ``context`` tokens (``--quantization int4``, graph runner):
    the prefill rate of a fresh ``context``-token prompt (from the time to its first token) and
    the decode rate of the ``output_len - 1`` tokens after it, averaged over ``reps`` requests
    after one warm-up request of the same length."""
    from pyxllm import LLM
    from pyxllm.benchmarks.latency import _timed_request

    engine = LLM(
        max_model_len=context + output_len + CONTEXT_MARGIN,
        kv_cache_memory=0.5,
        quantization="int4",
        graph_backend=GRAPH_BACKEND,
    ).llm_engine
    prompts = [ids for _, ids in make_prompts(tokenizer, reps + 1, context, "random", seed=4096)]
    _timed_request(engine, prompts[0], 8, "warm-long")
    runs = [
        _timed_request(engine, ids, output_len, f"long-{i}") for i, ids in enumerate(prompts[1:])
    ]
    return {
        "prompt_tokens_mean": sum(len(ids) for ids in prompts[1:]) / reps,
        "prefill_tok_s": sum(len(ids) / r[0] for ids, r in zip(prompts[1:], runs)) / reps,
        "decode_tok_s": sum((n - 1) / (e2e - t) for t, e2e, n in runs) / reps,
        "prefix_cache_hits": engine.stats()["prefix_cache_hits"],
    }


def ratio_rows(results: dict, output_len: int, context: int) -> list[str]:
    """The summary lines of both sections, with pyxllm's ratios."""
    lines = []
    for label, servers in results.get("llama-server", {}).items():
        input_len, clients = label.split("x")
        peer = {"llama-server": servers.get("llama-server", {})}
        for ours_name, flags in (("pyxllm", "no flags"), ("pyxllm w8a8", "w8a8 + graph")):
            ours = servers.get(ours_name, {})
            title = (
                f"Serving ({flags}), {input_len}-token prompts, {output_len} new, {clients} clients"
            )
            for key, what, unit, lower in (
                ("output_tok_s", "output", "tok/s", False),
                ("median_ttft_ms", "median TTFT", "ms", True),
            ):
                lines += ratio_lines(
                    f"{title}, {what}",
                    ours.get(key),
                    {name: figures.get(key) for name, figures in peer.items()},
                    unit,
                    lower_better=lower,
                )
    long = results.get("long-context", {})
    if long:
        ours, peer = long.get("pyxllm", {}), long.get("llama-bench", {})
        lines += ratio_lines(
            f"Batch-1 decode at {context} tokens of context (int4)",
            ours.get("decode_tok_s"),
            {f"llama-bench tg{output_len} @ d{context}": peer.get("decode_tok_s")},
            "tok/s",
        )
        lines += ratio_lines(
            f"Batch-1 prefill of {context} tokens (int4)",
            ours.get("prefill_tok_s"),
            {f"llama-bench pp{context}": peer.get("prefill_tok_s")},
            "tok/s",
        )
    return lines
