"""pyxllm against transformers, llama-cpp-python and llama.cpp's server on the same model and
prompts, in one run.

Sections (each printed with pyxllm's ratio to each peer that ran; ``--only`` and ``--skip``
take comma-separated names):

1. ``offline``: pyxllm's offline throughput, ``--num-prompts`` prompts of ``--input-len``
   tokens generating exactly ``--output-len`` tokens each (greedy), with pyxllm's ``LLM``
   with no flags (the GGUF's weights as stored, ``--dtype auto``: bfloat16 on CPUs with native
   bf16) and with ``--quantization w8a8`` (int8 matmuls); and its batch-1 figures: prefill
   rate of one prompt and decode rate of ``--output-len`` tokens, with no flags and with
   ``--quantization int4``. pyxllm runs ``--graph-backend graph`` throughout.
   The peers of these rows: ``transformers`` (``generate`` in bfloat16, batches of
   ``--hf-batch-size`` (16) with left padding) and ``llamacpp`` (llama-cpp-python one request
   at a time on the GGUF, on ``--llamacpp-prompts`` of them: it has no batching).
2. ``serving``, ``--concurrency`` (8) clients: ``pyxllm serve --quantization w8a8`` against
   ``python -m llama_cpp.server`` (extra ``llamacpp``; it runs one request at a time), both
   driven by ``pyxllm bench serve``'s client: aggregate output tok/s and median TTFT.
3. ``llama-server``: the same client against ``pyxllm serve`` and llama.cpp's own server with
   parallel slots and continuous batching, at 100-token prompts with 8 and 32 clients and
   1000-token prompts with 8 (``--llama-server-workloads``, ``--requests-per-client``);
   ``long-context``: batch 1 at ``--long-context`` (4096) tokens of context, llama-bench
   ``pp4096`` and ``tg128 @ d4096`` against pyxllm int4 (see ``llama_server.py``). Their
   binaries come from ``benchmarks/build_llama_server.sh`` (``--llama-server-dir``).
4. ``speculative``, batch 1, input-grounded prompts (``speculative.py``'s): pyxllm int4 and
   unquantized (``--dtype auto``) without and with n-gram speculation, llama-cpp-python
   without and with its prompt-lookup decoding (after every pyxllm run in this process), 256
   new tokens each.
5. ``invariance``: ``pyxllm serve`` with no flags (batch-invariant) against the same with
   ``--no-batch-invariant``, at 1, 8 and 32 clients of 100-token prompts and 8 of 1000-token
   ones: what invariance costs (see ``invariance.py``).

With ``--model-shape 1b`` the model is instead a random one of Llama-3.2-1B's shapes, built once
in a cache directory as safetensors and as GGUF Q4_0 / Q8_0 / Q4_K_M, and the sections are
``batch-1``, ``llama-server`` and ``busy-core``: pyxllm with no flags against llama-bench and
llama-server on the same files (see ``model_1b.py``).

Peers that are not installed or built are skipped with a message. Every engine gets
``--threads`` threads (default: all cores). Run from the repository root::

    .venv/bin/python benchmarks/compare.py                      # every section
    .venv/bin/python benchmarks/compare.py --skip serving --result-file compare.json
    benchmarks/build_llama_server.sh && \
        .venv/bin/python benchmarks/compare.py --only llama-server,long-context --threads 2
    .venv/bin/python benchmarks/compare.py --model-shape 1b --threads 2 --requests-per-client 1
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import sys
import time

import invariance
import llama_server
import model_1b
import speculative
import torch
from harness import GRAPH_BACKEND, log, measure_server, pyxllm_serve_cmd, ratio_lines

from pyxllm.benchmarks.prompts import make_prompts
from pyxllm.weights.source import default_gguf_path


def hf_throughput(path, prompts, output_len: int, batch_size: int) -> dict:
    """transformers bf16 ``generate``, batches of ``batch_size`` left-padded prompts."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, padding_side="left")
    tok.pad_token = tok.pad_token or tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.bfloat16
    ).eval()

    def run(batch):
        enc = tok.pad({"input_ids": batch}, return_tensors="pt")
        with torch.inference_mode():
            out = model.generate(
                **enc,
                max_new_tokens=output_len,
                min_new_tokens=output_len,
                do_sample=False,
                pad_token_id=tok.pad_token_id,
            )
        return out.shape[1] - enc["input_ids"].shape[1]

    run([prompts[0][:8]])  # warm-up
    start, produced = time.perf_counter(), 0
    for i in range(0, len(prompts), batch_size):
        batch = prompts[i : i + batch_size]
        produced += run(batch) * len(batch)
    elapsed = time.perf_counter() - start
    one = prompts[0]
    t0 = time.perf_counter()
    with torch.inference_mode():
        model.generate(
            torch.tensor([one]),
            max_new_tokens=output_len,
            min_new_tokens=output_len,
            do_sample=False,
        )
    decode = output_len / (time.perf_counter() - t0)
    return {"output_tok_s": produced / elapsed, "elapsed_s": elapsed, "batch1_e2e_tok_s": decode}


def llamacpp_figures(path, prompts, output_len: int, threads: int, num: int, fresh) -> dict:
    """llama-cpp-python: prompts one at a time; output rate over ``prompts[:num]``, prefill and
    decode rates (from streamed tokens) over the ``fresh`` prompts."""
    from llama_cpp import Llama

    llm = Llama(model_path=str(path), n_ctx=2048, n_threads=threads, n_batch=512, verbose=False)
    llm.create_completion(prompts[0][:8], max_tokens=4)  # warm-up
    start, produced = time.perf_counter(), 0
    for ids in prompts[:num]:
        llm.reset()
        produced += llm.create_completion(ids, max_tokens=output_len, temperature=0.0)["usage"][
            "completion_tokens"
        ]
    elapsed = time.perf_counter() - start
    prefill, decode = [], []
    for ids in fresh:
        llm.reset()
        t0, first, n = time.perf_counter(), None, 0
        for _ in llm.create_completion(ids, max_tokens=output_len, temperature=0.0, stream=True):
            n += 1
            first = first or time.perf_counter()
        end = time.perf_counter()
        prefill.append(len(ids) / (first - t0))
        decode.append((n - 1) / (end - first))
    return {
        "output_tok_s": produced / elapsed,
        "prefill_tok_s": sum(prefill) / len(prefill),
        "decode_tok_s": sum(decode) / len(decode),
        "requests": num,
    }


def pyxllm_figures(prompts, output_len: int, fresh) -> dict:
    """pyxllm offline throughput (no flags: the GGUF's weights as stored, ``--dtype auto``; and
    w8a8) and batch-1 rates with no flags and with ``--quantization int4``, on the ``fresh``
    prompts (not seen before: no prefix-cache hit)."""
    from pyxllm import LLM, SamplingParams
    from pyxllm.benchmarks.latency import _timed_request

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)

    def offline(llm) -> float:
        llm.generate(
            [{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=4, ignore_eos=True)
        )
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)

    figures = {}
    llm = LLM(max_model_len=1024, kv_cache_memory=1.0, graph_backend=GRAPH_BACKEND)
    figures["dtype"] = str(llm.llm_engine.executor.dtype).removeprefix("torch.")
    figures["output_tok_s"] = offline(llm)
    figures["w8a8_output_tok_s"] = offline(
        LLM(
            max_model_len=1024,
            kv_cache_memory=1.0,
            quantization="w8a8",
            graph_backend=GRAPH_BACKEND,
        )
    )
    gc.collect()
    for name, engine in (
        ("defaults", llm.llm_engine),
        (
            "int4",
            LLM(
                max_model_len=1024,
                kv_cache_memory=0.2,
                quantization="int4",
                graph_backend=GRAPH_BACKEND,
            ).llm_engine,
        ),
    ):
        _timed_request(engine, prompts[1][::-1], 8, f"warm-{name}")
        runs = [
            _timed_request(engine, ids, output_len, f"{name}-{i}") for i, ids in enumerate(fresh)
        ]
        figures[f"{name}_prefill_tok_s"] = sum(
            len(ids) / r[0] for ids, r in zip(fresh, runs)
        ) / len(runs)
        figures[f"{name}_decode_tok_s"] = sum((n - 1) / (e2e - t) for t, e2e, n in runs) / len(runs)
    return figures


def serving(
    prompts, warmup, output_len: int, concurrency: int, threads: int, llamacpp: bool
) -> dict:
    """Aggregate output tok/s and median TTFT of pyxllm's and (with ``llamacpp``) the
    llama-cpp-python server under ``concurrency`` clients, after the ``warmup`` prompts."""
    path = default_gguf_path()
    servers = {
        "pyxllm": pyxllm_serve_cmd(
            18931,
            "--quantization",
            "w8a8",
            "--max-model-len",
            "1024",
            "--kv-cache-memory",
            "0.5",
            "--graph-backend",
            GRAPH_BACKEND,
        )
    }
    if llamacpp:
        servers["llama.cpp"] = [
            sys.executable,
            "-m",
            "llama_cpp.server",
            "--model",
            str(path),
            "--port",
            "18932",
            "--n_threads",
            str(threads),
            "--n_ctx",
            "2048",
        ]
    return {
        name: measure_server(
            name,
            cmd,
            int(cmd[cmd.index("--port") + 1]),
            threads,
            {"load": (prompts, output_len, concurrency)},
            warmup,
        )["load"]
        for name, cmd in servers.items()
    }


SECTIONS = (
    "offline",
    "transformers",
    "llamacpp",
    "serving",
    "speculative",
    "llama-server",
    "long-context",
    "invariance",
)


def sections_to_run(
    parser: argparse.ArgumentParser, only: str, skip: str, names=SECTIONS
) -> tuple[set[str], set[str]]:
    """``(sections to run, sections skipped)``: those ``--only`` names (default: all ``names``)
    less those ``--skip`` names; an unknown name is a usage error naming its flag."""
    chosen = {}
    for flag, text in (("--only", only), ("--skip", skip)):
        chosen[flag] = set(filter(None, text.split(",")))
        unknown = chosen[flag] - set(names)
        if unknown:
            parser.error(
                f"{flag}: unknown section {', '.join(sorted(unknown))} "
                f"(choose from {', '.join(names)})"
            )
    return (chosen["--only"] or set(names)) - chosen["--skip"], chosen["--skip"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=100)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument(
        "--llamacpp-prompts", type=int, default=4, help="llama.cpp runs these one by one"
    )
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--serving-prompts", type=int, default=24)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument(
        "--only", default="", help=f"comma-separated sections: {','.join(SECTIONS)}"
    )
    parser.add_argument("--skip", default="", help="comma-separated sections not to run")
    parser.add_argument(
        "--llama-server-dir",
        default=str(llama_server.DEFAULT_BIN_DIR),
        help="where benchmarks/build_llama_server.sh put llama-server and llama-bench",
    )
    parser.add_argument(
        "--llama-server-workloads",
        default=llama_server.DEFAULT_WORKLOADS,
        help="PROMPT_TOKENSxCLIENTS, comma-separated",
    )
    parser.add_argument("--requests-per-client", type=int, default=3)
    parser.add_argument("--long-context", type=int, default=4096, help="tokens of context")
    parser.add_argument(
        "--long-context-reps", type=int, default=3, help="timed requests / llama-bench repetitions"
    )
    parser.add_argument("--result-file", default=None)
    parser.add_argument(
        "--model-shape",
        choices=("135m", "1b"),
        default="135m",
        help="135m: the embedded SmolLM2 (the sections above); 1b: a random model of "
        f"Llama-3.2-1B's shapes, sections {', '.join(model_1b.SECTIONS)} (model_1b.py)",
    )
    parser.add_argument(
        "--model-1b-dir",
        default=str(model_1b.DEFAULT_DIR),
        help="where --model-shape 1b builds its checkpoints (about 5 GB)",
    )
    parser.add_argument(
        "--model-1b-types",
        default=model_1b.DEFAULT_TYPES,
        help=f"--model-shape 1b's GGUF types, comma-separated ({', '.join(model_1b.FILE_TYPES)})",
    )
    args = parser.parse_args()
    if args.model_shape == "1b":
        args.sections, _ = sections_to_run(parser, args.only, args.skip, model_1b.SECTIONS)
        try:
            model_1b.parse_types(args.model_1b_types)
            llama_server.parse_workloads(args.llama_server_workloads)
        except ValueError as e:
            parser.error(str(e))
        torch.set_num_threads(args.threads)
        binaries = llama_server.find_binaries(
            args.llama_server_dir,
            ("llama-server", "llama-bench", "llama-quantize"),
            "--model-shape 1b",
        )
        if binaries is not None:
            lines = model_1b.run(args, binaries, log, ratio_lines)
            log(
                "\n".join(
                    [
                        "",
                        "=== pyxllm vs llama.cpp, 1B shapes (ratios > 1: pyxllm better) ===",
                        *lines,
                    ]
                )
            )
        return
    sections, skipped = sections_to_run(parser, args.only, args.skip)
    try:
        workloads = llama_server.parse_workloads(args.llama_server_workloads)
    except ValueError as e:
        parser.error(str(e))
    for flag in ("requests_per_client", "long_context", "long_context_reps"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')}: must be >= 1, got {getattr(args, flag)}")

    torch.set_num_threads(args.threads)
    # find, not import: llama.cpp's library brings its own OpenMP runtime, whose threads compete
    # with torch's for the cores (pyxllm's batch-1 figures halved when it was imported first)
    llamacpp = "llamacpp" not in skipped and importlib.util.find_spec("llama_cpp") is not None
    if (
        {"llamacpp", "serving", "speculative"} & sections
        and not llamacpp
        and "llamacpp" not in skipped
    ):
        log(
            "llama-cpp-python is not installed (.venv/bin/pip install 'pyxllm[llamacpp]', "
            "a source build of minutes): skipped"
        )
    if not llamacpp:
        sections.discard("llamacpp")
    binaries = None
    if {"llama-server", "long-context"} & sections:
        binaries = llama_server.find_binaries(args.llama_server_dir)
        if binaries is None:
            sections -= {"llama-server", "long-context"}
    from pyxllm.benchmarks.prompts import load_tokenizer

    path, tokenizer = default_gguf_path(), load_tokenizer(None)
    prompts = make_prompts(tokenizer, args.num_prompts, args.input_len, "random", seed=0)
    ids = [p[1] for p in prompts]
    fresh = [
        p[1] for p in make_prompts(tokenizer, 2, args.input_len, "random", seed=1)
    ]  # batch-1 figures
    names = ", ".join(s for s in SECTIONS if s in sections) or "none"
    log(
        f"sections: {names}; {len(ids)} prompts of ~{args.input_len} tokens, {args.output_len} "
        f"new tokens each, {args.threads} threads"
    )
    results = {}
    if "offline" in sections:
        results["pyxllm"] = pyxllm_figures(ids, args.output_len, fresh)
        log("pyxllm:", json.dumps(results["pyxllm"]))
        gc.collect()
    if "speculative" in sections:
        # int4 (the fastest at batch 1) and unquantized (where verifying 8 rows costs least)
        results["speculative"] = {q: speculative.pyxllm_figures(q) for q in ("int4", "none")}
        log("speculative:", json.dumps(results["speculative"]))
        gc.collect()
    if "long-context" in sections:
        results["long-context"] = {
            "pyxllm": llama_server.pyxllm_long_context(
                tokenizer, args.long_context, args.output_len, args.long_context_reps
            ),
            "llama-bench": llama_server.llama_bench(
                binaries["llama-bench"],
                args.long_context,
                args.output_len,
                args.long_context_reps,
                args.threads,
            ),
        }
        log("long-context:", json.dumps(results["long-context"]))
        gc.collect()
    if "transformers" in sections:
        results["transformers"] = hf_throughput(path, ids, args.output_len, args.hf_batch_size)
        log("transformers:", json.dumps(results["transformers"]))
        gc.collect()
    if "llamacpp" in sections:
        results["llama.cpp"] = llamacpp_figures(
            path, ids, args.output_len, args.threads, args.llamacpp_prompts, fresh
        )
        log("llama.cpp:", json.dumps(results["llama.cpp"]))
        gc.collect()
    if "speculative" in sections and llamacpp:  # after every in-process pyxllm run (see above)
        results["speculative"]["llama.cpp"] = speculative.llamacpp_figures(args.threads)
        log("speculative, llama.cpp:", json.dumps(results["speculative"]["llama.cpp"]))
    if "serving" in sections:
        results["serving"] = serving(
            prompts[: args.serving_prompts],
            make_prompts(tokenizer, 2, args.input_len, "random", seed=2),
            args.output_len,
            args.concurrency,
            args.threads,
            llamacpp,
        )
        log("serving:", json.dumps(results["serving"]))
    if "llama-server" in sections:
        results["llama-server"] = llama_server.serving(
            binaries["llama-server"],
            tokenizer,
            workloads,
            args.output_len,
            args.requests_per_client,
            args.threads,
        )
    if "invariance" in sections:
        results["invariance"] = invariance.run(
            tokenizer, args.output_len, args.requests_per_client, args.threads
        )
    lines = ["", "=== pyxllm vs peers (ratios > 1: pyxllm better) ==="]
    lines += offline_rows(results)
    serve = results.get("serving", {})
    if "pyxllm" in serve:
        lines += ratio_lines(
            f"Serving, {args.concurrency} clients, output",
            serve["pyxllm"]["output_tok_s"],
            {"llama-cpp-python server": serve.get("llama.cpp", {}).get("output_tok_s")},
            "tok/s",
        )
        lines += ratio_lines(
            "Serving, median TTFT",
            serve["pyxllm"]["median_ttft_ms"],
            {"llama-cpp-python server": serve.get("llama.cpp", {}).get("median_ttft_ms")},
            "ms",
            lower_better=True,
        )
    lines += llama_server.ratio_rows(results, args.output_len, args.long_context)
    lines += invariance.ratio_rows(results.get("invariance", {}), args.output_len)
    spec = results.get("speculative", {})
    llama = spec.get("llama.cpp", {})
    for quantization, name in (("int4", "int4"), ("none", "unquantized")):
        if quantization in spec:
            lines += ratio_lines(
                f"Speculative decoding, grounded batch 1 ({name}, n-gram)",
                spec[quantization]["with"],
                {
                    "pyxllm without speculation": spec[quantization]["without"],
                    "llama.cpp prompt lookup": llama.get("llama.cpp prompt lookup"),
                    "llama.cpp": llama.get("llama.cpp"),
                },
                "tok/s",
            )
    log("\n".join(lines))
    if args.result_file:
        with open(args.result_file, "w") as f:
            json.dump(results, f, indent=2)


def offline_rows(results: dict) -> list[str]:
    """The offline and batch-1 summary lines (none without pyxllm's offline figures)."""
    ours, hf, lc = (
        results.get("pyxllm"),
        results.get("transformers", {}),
        results.get("llama.cpp", {}),
    )
    if ours is None:
        return []
    offline_peers = {
        "transformers bf16 batch 16": hf.get("output_tok_s"),
        "llama.cpp sequential": lc.get("output_tok_s"),
    }
    lines = ratio_lines(
        f"Offline throughput (no flags, {ours['dtype']})",
        ours["output_tok_s"],
        offline_peers,
        "output tok/s",
    )
    lines += ratio_lines(
        "Offline throughput (w8a8)", ours["w8a8_output_tok_s"], offline_peers, "output tok/s"
    )
    for kind, label in (("defaults", "no flags"), ("int4", "--quantization int4")):
        lines += ratio_lines(
            f"Batch-1 decode ({label})",
            ours[f"{kind}_decode_tok_s"],
            {
                "llama.cpp Q4_1": lc.get("decode_tok_s"),
                "transformers bf16 (end to end)": hf.get("batch1_e2e_tok_s"),
            },
            "tok/s",
        )
        lines += ratio_lines(
            f"Batch-1 prefill ({label})",
            ours[f"{kind}_prefill_tok_s"],
            {"llama.cpp Q4_1": lc.get("prefill_tok_s")},
            "tok/s",
        )
    return lines


if __name__ == "__main__":
    main()
