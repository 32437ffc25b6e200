"""``pyxllm bench serve``: load-test any OpenAI-compatible server (pyxllm, vLLM, llama.cpp ...).

Sends ``--num-prompts`` streaming ``/completions`` requests (temperature 0, ``max_tokens`` =
``--output-len``, ``ignore_eos`` unless ``--no-ignore-eos``) with at most ``--max-concurrency``
in flight, arriving as a Poisson process of ``--request-rate`` per second (``inf``: all at
once). Each chunk's arrival time is taken when its SSE line is read; the metrics are those of
:mod:`pyxllm.benchmarks.metrics`, written as a table, JSON (``--result-file``) and a PNG
(``--plot-file``, default: the result file with ``.png``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from pathlib import Path

from pyxllm.benchmarks.metrics import RequestRecord, compute_metrics
from pyxllm.benchmarks.prompts import DATASETS, load_tokenizer, make_prompts
from pyxllm.benchmarks.report import format_table, plot_png, write_json
from pyxllm.entrypoints.flags import parse_bool


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """The flags of ``pyxllm bench serve``."""
    parser.add_argument(
        "--base-url",
        default="http://127.0.0.1:8000/v1",
        help="the server's OpenAI API root (ends in /v1)",
    )
    parser.add_argument(
        "--model-name",
        default=None,
        help="the model name to send (default: the first of GET /models)",
    )
    parser.add_argument(
        "--lora-modules",
        type=lambda text: [name.strip() for name in text.split(",") if name.strip()],
        default=None,
        metavar="NAME[,NAME...]",
        help="send the requests to these model names (a server's LoRA adapters) in turn, "
        "request i to name i mod N (vLLM's bench flag picks one at random) (default: "
        "--model-name)",
    )
    parser.add_argument(
        "--tokenizer",
        default=None,
        metavar="PATH",
        help="tokenizer for building prompts of --input-len tokens: a .gguf file or HF "
        "directory (default: the embedded SmolLM2)",
    )
    parser.add_argument(
        "--dataset", choices=DATASETS, default="random", help="random or fixed prompt texts"
    )
    parser.add_argument("--num-prompts", type=int, default=64, help="requests to send")
    parser.add_argument("--input-len", type=int, default=100, help="prompt length in tokens")
    parser.add_argument("--output-len", type=int, default=128, help="max_tokens of each request")
    parser.add_argument("--max-concurrency", type=int, default=8, help="most requests in flight")
    parser.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="mean arrivals per second (Poisson); inf sends all at once",
    )
    parser.add_argument(
        "--ignore-eos",
        type=parse_bool,
        default=True,
        metavar="BOOL",
        help="ask the server to generate exactly --output-len tokens",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompts and arrival times")
    parser.add_argument(
        "--timeout", type=float, default=600.0, help="seconds before a request fails"
    )
    parser.add_argument(
        "--result-file", default=None, metavar="PATH", help="write the results as JSON here"
    )
    parser.add_argument(
        "--plot-file",
        default=None,
        metavar="PATH",
        help="write the PNG plot here (default: the result file with .png)",
    )
    parser.add_argument("--label", default="pyxllm bench serve", help="title of the table and plot")
    parser.add_argument(
        "--structured-output",
        choices=("none", "json"),
        default="none",
        help="json: every request carries response_format json_schema (BENCH_SCHEMA, the same for "
        "all, so the server compiles it once); the payload reports the first request's TTFT",
    )


# The schema of --structured-output json: nested objects, an array, an enum and bounded numbers.
BENCH_SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
        "genre": {"enum": ["drama", "comedy", "thriller", "documentary"]},
        "cast": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"name": {"type": "string"}, "role": {"type": "string"}},
                "required": ["name", "role"],
            },
        },
        "rating": {"type": "number", "minimum": 0, "maximum": 10},
    },
    "required": ["title", "year", "genre", "cast", "rating"],
}


def structured_output_fields(kind: str) -> dict:
    """The request fields of ``--structured-output``."""
    if kind == "none":
        return {}
    schema = {"name": "bench", "schema": BENCH_SCHEMA}
    return {"response_format": {"type": "json_schema", "json_schema": schema}}


async def _one_request(client, url: str, body: dict, record: RequestRecord) -> None:
    """Stream one completion, filling ``record``; errors are recorded, never raised."""
    record.start = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                record.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return
            chunks = 0
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                event = json.loads(data)
                usage = event.get("usage")
                if usage:
                    record.prompt_tokens = usage.get("prompt_tokens") or record.prompt_tokens
                    record.output_tokens = usage.get("completion_tokens") or 0
                choices = event.get("choices") or []
                if choices and choices[0].get("text"):
                    record.chunk_times.append(now)
                    chunks += 1
            record.output_tokens = record.output_tokens or chunks
        record.end = time.perf_counter()
        record.success = bool(record.chunk_times)
        if not record.success:
            record.error = "no text in the response"
    except Exception as e:  # noqa: BLE001 - a failed request is a result, not a crash
        record.end = time.perf_counter()
        record.error = f"{type(e).__name__}: {e}"


async def first_model(client, base_url: str) -> str:
    """The first model ``GET /models`` lists.

    Raises:
        ValueError: naming ``--base-url``, when the server cannot be reached or refuses.
    """
    import httpx  # lazy: httpx is optional (pyxllm[bench])

    try:
        response = await client.get(f"{base_url}/models")
    except httpx.HTTPError as e:
        raise ValueError(f"--base-url {base_url}: {type(e).__name__}: {e}") from e
    if response.status_code != 200:
        raise ValueError(
            f"--base-url {base_url}: GET /models answered HTTP {response.status_code}: "
            f"{response.text[:200]}"
        )
    return response.json()["data"][0]["id"]


async def run_benchmark(
    base_url: str,
    prompts: list[tuple[str, list[int]]],
    output_len: int,
    max_concurrency: int,
    request_rate: float = float("inf"),
    model_name: str | None = None,
    ignore_eos: bool = True,
    seed: int = 0,
    timeout: float = 600.0,
    extra_fields: dict | None = None,
    model_names: list[str] | None = None,
) -> tuple[list[RequestRecord], float]:
    """Send every prompt (each request's body also gets ``extra_fields``; with
    ``model_names``, request ``i`` names ``model_names[i % len(model_names)]``); returns the
    per-request records, in the order sent, and the wall duration in seconds.

    Raises:
        ValueError: the server cannot list its models (when ``model_name`` is None).
    """
    import httpx  # lazy: httpx is optional (pyxllm[bench])

    base_url = base_url.rstrip("/")
    limits = httpx.Limits(
        max_connections=max_concurrency + 2, max_keepalive_connections=max_concurrency + 2
    )
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        model = model_name or await first_model(client, base_url)
        semaphore = asyncio.Semaphore(max_concurrency)
        rng = random.Random(seed)
        records = [RequestRecord(prompt_tokens=len(ids)) for _, ids in prompts]

        async def limited(text: str, record: RequestRecord, model: str) -> None:
            body = {
                "model": model,
                "prompt": text,
                "max_tokens": output_len,
                "temperature": 0.0,
                "stream": True,
                "stream_options": {"include_usage": True},
                **(extra_fields or {}),
            }
            if ignore_eos:
                body["ignore_eos"] = True
            async with semaphore:
                await _one_request(client, f"{base_url}/completions", body, record)

        start = time.perf_counter()
        tasks = []
        names = model_names or [model]
        for i, ((text, _), record) in enumerate(zip(prompts, records)):
            tasks.append(asyncio.create_task(limited(text, record, names[i % len(names)])))
            if request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(request_rate))
        await asyncio.gather(*tasks)
        return records, time.perf_counter() - start


def bench_serve(args: argparse.Namespace) -> dict:
    """Run ``pyxllm bench serve`` from parsed flags; prints the table, writes the files and
    returns the JSON payload."""
    tokenizer = load_tokenizer(args.tokenizer)
    prompts = make_prompts(tokenizer, args.num_prompts, args.input_len, args.dataset, args.seed)
    records, duration = asyncio.run(
        run_benchmark(
            args.base_url,
            prompts,
            args.output_len,
            args.max_concurrency,
            args.request_rate,
            args.model_name,
            args.ignore_eos,
            args.seed,
            args.timeout,
            structured_output_fields(args.structured_output),
            args.lora_modules,
        )
    )
    metrics = compute_metrics(records, duration)
    print(format_table(metrics, args.label))
    errors = sorted({r.error for r in records if not r.success})
    if errors:
        print("errors:", *errors[:5], sep="\n  ")
    payload = {
        "label": args.label,
        "base_url": args.base_url,
        "dataset": args.dataset,
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "max_concurrency": args.max_concurrency,
        "request_rate": None if args.request_rate == float("inf") else args.request_rate,
        "structured_output": args.structured_output,
        "first_ttft_ms": None if records[0].ttft is None else 1000 * records[0].ttft,
        **metrics.to_dict(),
        "errors": errors[:5],
    }
    if args.result_file:
        print(f"results: {write_json(args.result_file, payload)}")
    plot = args.plot_file or (
        str(Path(args.result_file).with_suffix(".png")) if args.result_file else None
    )
    if plot and plot_png(plot, metrics, records, args.label):
        print(f"plot: {plot}")
    return payload
