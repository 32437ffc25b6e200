"""compare.py's ``invariance`` section: what batch invariance (``--batch-invariant``, the default)
costs a server, against the same server with ``--no-batch-invariant``, in one run.

Both servers serve the embedded GGUF with no other flag (its weights as stored, the graph
runner), one after the other, each driven by ``pyxllm bench serve``'s client over the same
prompts: ``--requests-per-client`` random 100-token prompts per client at 1, 8 and 32 clients,
and 1000-token prompts at 8 clients (long prompts, where the invariant prefill runs the integer
kernel at every row count instead of a BLAS GEMM on dequantized weights), ``--output-len`` new
tokens each, ``ignore_eos``. A warm-up load of other prompts goes first. Printed per workload:
aggregate output tok/s, median TPOT and median TTFT, with the invariant server's ratio to the
other (above 1: invariance costs nothing there).
"""

from __future__ import annotations

import json

from harness import log, measure_server, pyxllm_serve_cmd, ratio_lines

from pyxllm.benchmarks.prompts import make_prompts

# (prompt tokens, clients)
WORKLOADS = ((100, 1), (100, 8), (100, 32), (1000, 8))
# a KV budget and batch size that hold every workload's sequences at once
SIZING = "--max-model-len 1280 --kv-cache-memory 1.0 --max-seqs-per-batch 64".split()
SERVERS = {
    "invariant": (18941, ()),
    "not invariant": (18942, ("--no-batch-invariant",)),
}


def run(tokenizer, output_len: int, requests_per_client: int, threads: int) -> dict:
    """``{workload label: {server name: figures}}`` (figures as ``harness.measure_server``
    gives them), each server started once for all the workloads."""
    loads = {
        f"{n}x{c}": (
            make_prompts(tokenizer, c * requests_per_client, n, "random", seed=2000 + i),
            output_len,
            c,
        )
        for i, (n, c) in enumerate(WORKLOADS)
    }
    warmup = make_prompts(tokenizer, 2, 32, "random", seed=1999)
    results: dict[str, dict] = {label: {} for label in loads}
    for name, (port, flags) in SERVERS.items():
        cmd = pyxllm_serve_cmd(port, *SIZING, *flags)
        for label, figures in measure_server(name, cmd, port, threads, loads, warmup).items():
            results[label][name] = figures
            log(f"invariance, {name} {label}:", json.dumps(figures))
    return results


def ratio_rows(results: dict, output_len: int) -> list[str]:
    """The summary lines: the invariant server's figures, with the other server's as the
    peer."""
    lines = []
    for label, servers in results.items():
        input_len, clients = label.split("x")
        ours, peer = servers.get("invariant", {}), servers.get("not invariant", {})
        title = f"Batch invariance, {input_len}-token prompts, {output_len} new, {clients} clients"
        for key, what, unit, lower in (
            ("output_tok_s", "output", "tok/s", False),
            ("median_tpot_ms", "median TPOT", "ms", True),
            ("median_ttft_ms", "median TTFT", "ms", True),
        ):
            lines += ratio_lines(
                f"{title}, {what}",
                ours.get(key),
                {"--no-batch-invariant": peer.get(key)},
                unit,
                lower_better=lower,
            )
    return lines
