"""``pyxllm bench eval``: score a task through any OpenAI-compatible server (pyxllm, vLLM,
llama.cpp's server ...), as evalscope and lm-evaluation-harness do.

Task ``gsm8k`` (:mod:`pyxllm.benchmarks.gsm8k`): ``--format evalscope`` sends chat completions,
``--format lm-eval`` completions; greedy (temperature 0), ``--max-tokens`` each, at most
``--max-concurrency`` in flight, with a progress bar. It prints evalscope's two tables,
accuracy (Model, Dataset, Metric, Subset, Num, Score) and speed (Num, Avg Lat (s), Avg Thpt
(tok/s): output tokens over the request's latency, Avg In, Avg Out: usage tokens), and with
``--result-file`` writes them as JSON with every sample's prompt, output, extracted and gold
answer.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from dataclasses import asdict, dataclass

from pyxllm.benchmarks import gsm8k
from pyxllm.benchmarks.report import write_json
from pyxllm.benchmarks.serve import first_model

TASKS = ("gsm8k",)


def add_eval_args(parser: argparse.ArgumentParser) -> None:
    """The flags of ``pyxllm bench eval``."""
    # its own dest: `task` is the engine setting (--task generate|embed) of the serve flags
    parser.add_argument(
        "--task", dest="eval_task", choices=TASKS, default="gsm8k", help="the task to score"
    )
    parser.add_argument(
        "--base-url",
        default="http://127.0.0.1:8000/v1",
        help="the server's OpenAI API root (ends in /v1)",
    )
    parser.add_argument(
        "--model-name", default=None, help="the model to send (default: the first of GET /models)"
    )
    parser.add_argument("--api-key", default=None, help="sent as a bearer token")
    parser.add_argument(
        "--format",
        choices=gsm8k.FORMATS,
        default="evalscope",
        help="evalscope: chat, \\boxed{} answers; lm-eval: completions, '#### N' answers",
    )
    parser.add_argument(
        "--limit", type=int, default=None, help="score the first N problems (default: all)"
    )
    parser.add_argument(
        "--num-fewshot",
        type=int,
        default=None,
        help="solved examples before each problem (default: 4 for evalscope, 5 for lm-eval)",
    )
    parser.add_argument("--max-concurrency", type=int, default=4, help="most requests in flight")
    parser.add_argument("--max-tokens", type=int, default=512, help="max_tokens of each request")
    parser.add_argument(
        "--timeout", type=float, default=600.0, help="seconds before a request fails"
    )
    parser.add_argument(
        "--result-file", default=None, metavar="PATH", help="write the report as JSON here"
    )


@dataclass(slots=True)
class Sample:
    """One scored problem: what was sent and returned, and the request's figures."""

    index: int
    prompt: str
    gold: str
    output: str = ""
    extracted: str | None = None
    correct: bool = False
    latency_s: float = 0.0
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str | None = None


def check_args(args: argparse.Namespace) -> None:
    """Reject flag values no run could use.

    Raises:
        ValueError: naming the flag.
    """
    for name in ("limit", "num_fewshot", "max_concurrency", "max_tokens"):
        value = getattr(args, name)
        low = 0 if name == "num_fewshot" else 1
        if value is not None and value < low:
            raise ValueError(f"--{name.replace('_', '-')}: must be >= {low}, got {value}")


def build_samples(fmt: str, limit: int | None, num_fewshot: int) -> list[Sample]:
    """The prompts of the first ``limit`` test problems in ``fmt``, after ``num_fewshot``
    training examples."""
    fewshot = gsm8k.load_problems("train", num_fewshot) if num_fewshot else []
    prompt = gsm8k.evalscope_prompt if fmt == "evalscope" else gsm8k.lm_eval_prompt
    return [
        Sample(i, prompt(problem, fewshot), problem.answer)
        for i, problem in enumerate(gsm8k.load_problems("test", limit))
    ]


def request_body(fmt: str, model: str, prompt: str, max_tokens: int) -> tuple[str, dict]:
    """``(path, body)`` of one greedy request in ``fmt``."""
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0.0}
    if fmt == "evalscope":
        return "/chat/completions", {**body, "messages": [{"role": "user", "content": prompt}]}
    return "/completions", {**body, "prompt": prompt, "stop": gsm8k.LM_EVAL_STOP}


async def _score(client, base_url: str, model: str, fmt: str, max_tokens: int, sample: Sample):
    path, body = request_body(fmt, model, sample.prompt, max_tokens)
    start = time.perf_counter()
    try:
        response = await client.post(base_url + path, json=body)
        sample.latency_s = time.perf_counter() - start
        if response.status_code != 200:
            sample.error = f"HTTP {response.status_code}: {response.text[:200]}"
            return
        payload = response.json()
        choice = payload["choices"][0]
        text = choice["message"]["content"] if fmt == "evalscope" else choice["text"]
        sample.output = text or ""
        usage = payload.get("usage") or {}
        sample.prompt_tokens = usage.get("prompt_tokens", 0)
        sample.output_tokens = usage.get("completion_tokens", 0)
    except Exception as e:  # noqa: BLE001 - a failed request is a result, not a crash
        sample.latency_s = time.perf_counter() - start
        sample.error = f"{type(e).__name__}: {e}"
        return
    extract = gsm8k.extract_evalscope if fmt == "evalscope" else gsm8k.extract_lm_eval
    sample.extracted = extract(sample.output)
    sample.correct = gsm8k.is_correct(sample.extracted, sample.gold)


async def run_eval(
    base_url: str,
    samples: list[Sample],
    fmt: str,
    max_tokens: int,
    max_concurrency: int,
    model_name: str | None = None,
    api_key: str | None = None,
    timeout: float = 600.0,
) -> str:
    """Send every sample's request, filling the samples in place; returns the model name.

    Raises:
        ValueError: the server cannot list its models (when ``model_name`` is None).
    """
    # lazy: httpx is optional (pyxllm[bench]), and `pyxllm bench --help` loads this module
    import httpx
    from tqdm import tqdm

    base_url = base_url.rstrip("/")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(timeout=timeout, headers=headers) as client:
        if model_name is None:
            model_name = await first_model(client, base_url)
        semaphore = asyncio.Semaphore(max_concurrency)
        # disable=None: no bar (and no carriage returns) when stderr is not a terminal
        bar = tqdm(total=len(samples), desc="gsm8k", unit="problem", disable=None)

        async def limited(sample: Sample) -> None:
            async with semaphore:
                await _score(client, base_url, model_name, fmt, max_tokens, sample)
            bar.update()

        try:
            await asyncio.gather(*(limited(s) for s in samples))
        finally:
            bar.close()
    return model_name


def summarize(samples: list[Sample], model: str, fmt: str) -> dict:
    """The accuracy and speed rows of the report (evalscope's columns)."""
    n = len(samples)
    done = [s for s in samples if s.error is None]

    def mean(values: list[float]) -> float:
        return sum(values) / len(values) if values else 0.0

    return {
        "accuracy": {
            "Model": model,
            "Dataset": "gsm8k",
            "Metric": "AverageAccuracy" if fmt == "evalscope" else "exact_match",
            "Subset": "main",
            "Num": n,
            "Score": sum(s.correct for s in samples) / n if n else 0.0,
        },
        "speed": {
            "Num": n,
            "Avg Lat (s)": mean([s.latency_s for s in done]),
            "Avg Thpt (tok/s)": mean([s.output_tokens / s.latency_s for s in done if s.latency_s]),
            "Avg In": mean([s.prompt_tokens for s in done]),
            "Avg Out": mean([s.output_tokens for s in done]),
        },
        "failed": sum(s.error is not None for s in samples),
    }


def format_tables(summary: dict) -> str:
    """The two tables as Markdown, as evalscope prints them."""
    lines = []
    for key, decimals in (("accuracy", 4), ("speed", 2)):
        row = summary[key]
        cells = [f"{v:.{decimals}f}" if isinstance(v, float) else str(v) for v in row.values()]
        lines += [
            "| " + " | ".join(row) + " |",
            "|" + "|".join("---" for _ in row) + "|",
            "| " + " | ".join(cells) + " |",
            "",
        ]
    return "\n".join(lines).rstrip()


def bench_eval(args: argparse.Namespace) -> dict:
    """Run ``pyxllm bench eval`` from parsed flags; prints the tables, writes the JSON and
    returns the report.

    Raises:
        ValueError: a flag value no run could use; FileNotFoundError: the data package is
            missing (the message gives the install command).
    """
    check_args(args)
    fewshot = gsm8k.DEFAULT_FEWSHOT[args.format] if args.num_fewshot is None else args.num_fewshot
    samples = build_samples(args.format, args.limit, fewshot)
    model = asyncio.run(
        run_eval(
            args.base_url,
            samples,
            args.format,
            args.max_tokens,
            args.max_concurrency,
            args.model_name,
            args.api_key,
            args.timeout,
        )
    )
    summary = summarize(samples, model, args.format)
    print(format_tables(summary))
    errors = sorted({s.error for s in samples if s.error})
    if errors:
        print(f"{summary['failed']} failed requests:", *errors[:5], sep="\n  ")
    report = {
        "task": args.eval_task,
        "format": args.format,
        "num_fewshot": fewshot,
        "max_tokens": args.max_tokens,
        "base_url": args.base_url,
        **summary,
        "samples": [asdict(s) for s in samples],
    }
    if args.result_file:
        print(f"results: {write_json(args.result_file, report)}")
    return report
