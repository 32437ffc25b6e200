"""``pyxllm run-batch``: a file of OpenAI batch requests answered offline by the server's app.

Each input line is a request in OpenAI's batch input format::

    {"custom_id": "q1", "method": "POST", "url": "/v1/chat/completions", "body": {...}}

(``url`` one of :data:`BATCH_URLS`). Its body goes to that route of the very app ``pyxllm
serve`` runs (:func:`~.api_server.build_app`), in this process through
``httpx.ASGITransport`` (no port is opened), up to ``max_concurrency`` requests at once so the
engine batches them; so a result's body is what the server answers for that body, an error
(a 400 naming the field) included. Each result is appended to the output as it finishes, in
OpenAI's batch output format::

    {"id": "batch_req_<hex>", "custom_id": "q1", "error": null,
     "response": {"status_code": 200, "request_id": "req_<hex>", "body": {...}}}

A line that cannot be sent (not a JSON object, no string ``custom_id``, a method other than
POST, a url not in :data:`BATCH_URLS`, a body that is not an object or asks for
``"stream": true``, a ``custom_id`` an earlier line has) gets ``"response": null`` and
``"error": {"code", "message", "line"}`` (``line`` counts from 1) instead; the run goes on.

Resuming: the custom_ids answered in an existing output file, and the lines its error lines
name, are skipped (a last line cut short by a stopped run is dropped first, and redone), so
running the same command again finishes a stopped run.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TextIO

import httpx

from pyxllm.config import EngineConfig
from pyxllm.engine.async_engine import AsyncEngine
from pyxllm.entrypoints.log_setup import ensure_logging
from pyxllm.entrypoints.openai.api_server import build_app
from pyxllm.entrypoints.openai.chat.reasoning import check_reasoning_parser
from pyxllm.entrypoints.openai.chat.tool_parsers import get_tool_parser
from pyxllm.entrypoints.openai.chat.tool_parsers.auto import AUTO, NONE
from pyxllm.entrypoints.openai.server_options import ServerOptions
from pyxllm.flag_fields import from_namespace

logger = logging.getLogger(__name__)

# the routes a batch line may name (OpenAI's batch endpoints that pyxllm serves)
BATCH_URLS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")


class BatchLineError(ValueError):
    """A line that cannot be sent: ``code`` (OpenAI's batch error codes: ``invalid_json_line``,
    ``missing_required_parameter``, ``invalid_value``, ``invalid_url``,
    ``duplicate_custom_id``) and the message; ``custom_id`` when the line has one."""

    def __init__(self, code: str, message: str, custom_id: str | None = None) -> None:
        super().__init__(message)
        self.code, self.custom_id = code, custom_id


@dataclass(frozen=True, slots=True)
class BatchRequest:
    """One line to send: its ``custom_id``, the route (``url``) and the JSON ``body``."""

    custom_id: str
    url: str
    body: dict[str, Any]


def parse_batch_line(text: str) -> BatchRequest:
    """The request of one input line.

    Raises:
        BatchLineError: the line cannot be sent (see the module's docstring), naming why.
    """
    try:
        line = json.loads(text)
    except ValueError as exc:
        raise BatchLineError("invalid_json_line", f"not valid JSON: {exc}") from None
    if not isinstance(line, dict):
        raise BatchLineError("invalid_json_line", "not a JSON object")
    custom_id = line.get("custom_id")
    if not isinstance(custom_id, str):
        raise BatchLineError("missing_required_parameter", "custom_id: a string is required")
    method, url, body = line.get("method", "POST"), line.get("url"), line.get("body")
    if method != "POST":
        message = f"method: {method!r} is not supported, only POST"
        raise BatchLineError("invalid_value", message, custom_id)
    if url not in BATCH_URLS:
        message = f"url: {url!r} is not one of {', '.join(BATCH_URLS)}"
        raise BatchLineError("invalid_url", message, custom_id)
    if not isinstance(body, dict):
        raise BatchLineError("missing_required_parameter", "body: an object is required", custom_id)
    if body.get("stream"):
        message = "body.stream: a batch request cannot be streamed; leave it out or false"
        raise BatchLineError("invalid_value", message, custom_id)
    return BatchRequest(custom_id, url, body)


def response_line(custom_id: str, status_code: int, request_id: str, body: Any) -> dict:
    """The output line of an answered request (any status: a 400's body is the error)."""
    response = {"status_code": status_code, "request_id": request_id, "body": body}
    return {"id": _new_id("batch_req"), "custom_id": custom_id, "response": response, "error": None}


def error_line(number: int, exc: BatchLineError) -> dict:
    """The output line of input line ``number`` (from 1), which could not be sent."""
    error = {"code": exc.code, "message": f"line {number}: {exc}", "line": number}
    return {
        "id": _new_id("batch_req"),
        "custom_id": exc.custom_id,
        "response": None,
        "error": error,
    }


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass(slots=True)
class BatchDone:
    """What an output file already holds: the ``custom_ids`` answered and the input ``lines``
    reported as errors (numbers from 1)."""

    custom_ids: set[str] = field(default_factory=set)
    lines: set[int] = field(default_factory=set)

    def __len__(self) -> int:
        return len(self.custom_ids) + len(self.lines)


def read_done(path: str) -> BatchDone:
    """The results already in the output file at ``path`` (none when it does not exist). A
    last line with no newline (cut short when a run stopped) is removed from the file.

    Raises:
        ValueError: a complete line is not a result line (the file is not run-batch's output).
    """
    done = BatchDone()
    if not os.path.exists(path):
        return done
    with open(path, "rb+") as file:
        data = file.read()
        complete = data[: data.rfind(b"\n") + 1]
        if len(complete) < len(data):
            logger.info("dropping %s's last line, cut short: it is run again", path)
            file.truncate(len(complete))
    for number, raw in enumerate(complete.splitlines(), 1):
        try:
            line = json.loads(raw)
            error, response = line["error"], line["response"]
            if response is not None:
                done.custom_ids.add(line["custom_id"])
            else:
                done.lines.add(int(error["line"]))
        except (ValueError, TypeError, KeyError) as exc:
            raise ValueError(
                f"--output-file {path}: line {number} is not a result line of run-batch "
                f"({type(exc).__name__}: {exc}); give a new file or one a run wrote"
            ) from None
    return done


@dataclass(slots=True)
class BatchCounts:
    """What a run did: lines ``answered`` (sent, any status), ``failed`` (not sent: an
    error line), ``skipped`` (already in the output)."""

    answered: int = 0
    failed: int = 0
    skipped: int = 0


async def run_batch(
    app,
    lines: Iterable[str],
    out: TextIO,
    max_concurrency: int,
    done: BatchDone | None = None,
    check_health: Callable[[], None] | None = None,
    progress=None,
) -> BatchCounts:
    """Send each input line's request to the ASGI ``app`` (up to ``max_concurrency`` at once)
    and write its result line to ``out`` as it finishes, skipping what ``done`` holds. Blank
    lines are ignored; ``progress`` (a tqdm bar) is advanced once per line.

    Raises:
        RuntimeError: the engine died (``check_health`` raised after a 5xx); the requests it
            failed get no line, so a rerun does them.
    """
    done = done or BatchDone()
    counts, seen, failure = BatchCounts(), set(), []
    semaphore = asyncio.Semaphore(max_concurrency)

    def write(line: dict) -> None:
        out.write(json.dumps(line, ensure_ascii=False) + "\n")
        out.flush()
        if progress is not None:
            progress.update(1)

    async def send(client: httpx.AsyncClient, request: BatchRequest) -> None:
        try:
            request_id = _new_id("req")
            headers = {"X-Request-Id": request_id}
            response = await client.post(request.url, json=request.body, headers=headers)
            if response.status_code >= 500 and check_health is not None:
                try:
                    check_health()
                except Exception as exc:  # noqa: BLE001 - any failure means the engine is lost
                    failure.append(str(exc))
                    return
            try:
                body = response.json()
            except ValueError:
                body = response.text
            write(response_line(request.custom_id, response.status_code, request_id, body))
            counts.answered += 1
        finally:
            semaphore.release()

    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    tasks: set[asyncio.Task] = set()
    async with httpx.AsyncClient(
        transport=transport, base_url="http://batch", timeout=None
    ) as client:
        for number, text in enumerate(lines, 1):
            if failure:
                break
            if not text.strip():
                continue
            try:
                request = parse_batch_line(text)
                if request.custom_id in seen:
                    message = f"custom_id {request.custom_id!r} is an earlier line's too"
                    raise BatchLineError("duplicate_custom_id", message, request.custom_id)
                seen.add(request.custom_id)
            except BatchLineError as exc:
                if exc.custom_id is not None:
                    seen.add(exc.custom_id)
                if number in done.lines:
                    counts.skipped += 1
                    if progress is not None:
                        progress.update(1)
                else:
                    write(error_line(number, exc))
                    counts.failed += 1
                continue
            if request.custom_id in done.custom_ids:
                counts.skipped += 1
                if progress is not None:
                    progress.update(1)
                continue
            await semaphore.acquire()
            task = asyncio.create_task(send(client, request))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.gather(*tasks)
    if failure:
        raise RuntimeError(f"{failure[0]}; the lines not yet written are left for a rerun")
    return counts


def server_options(args) -> ServerOptions:
    """The app's options from ``run-batch``'s response flags (no access log, no chat page).

    Raises:
        ValueError: an unknown reasoning or tool-call parser name.
    """
    check_reasoning_parser(args.reasoning_parser)
    if args.tool_call_parser not in (None, AUTO, NONE):
        get_tool_parser(args.tool_call_parser)
    return from_namespace(
        ServerOptions,
        args,
        access_log=False,
        web_ui=False,
        stats_interval=None,
        # never a 503 from admission control: the concurrency is ours
        max_waiting_requests=max(ServerOptions().max_waiting_requests, args.max_concurrency or 0),
    )


def run_batch_command(args, config: EngineConfig) -> int:
    """``pyxllm run-batch``: load the engine, answer ``args.input_file`` into
    ``args.output_file`` (see the module's docstring); 0 when every line has its result line.

    Raises:
        ValueError: a bad parser name or an output file that is not run-batch's (before the
            model loads).
        OSError: no input file (``FileNotFoundError``), or an output file that cannot be
            opened for appending.
        RuntimeError: the engine died (the lines not written are left for a rerun).
    """
    from tqdm import tqdm

    ensure_logging()
    options = server_options(args)
    if args.input_file == "-":
        lines = sys.stdin.read().splitlines()
    else:
        with open(args.input_file, encoding="utf-8") as file:
            lines = file.read().splitlines()
    to_stdout = args.output_file == "-"
    done = BatchDone() if to_stdout else read_done(args.output_file)
    # opened before the model loads: an output that cannot be written fails at once
    out = sys.stdout if to_stdout else open(args.output_file, "a", encoding="utf-8")
    engine = None
    try:
        engine = AsyncEngine.from_config(config)
        app = build_app(engine, options)
        concurrency = args.max_concurrency or engine.max_num_seqs
        total = sum(1 for text in lines if text.strip())
        logger.info(
            "run-batch: %d lines in %s, %d of them in %s already; up to %d at once",
            total,
            args.input_file,
            len(done),
            args.output_file,
            concurrency,
        )
        with tqdm(total=total, desc="run-batch", unit="req", disable=None) as progress:
            coroutine = run_batch(app, lines, out, concurrency, done, engine.check_health, progress)
            counts = asyncio.run(coroutine)
    finally:
        if not to_stdout:
            out.close()
        if engine is not None:
            engine.shutdown()
    logger.info(
        "run-batch: done: %d answered, %d not sent (error lines), %d skipped (already in %s)",
        counts.answered,
        counts.failed,
        counts.skipped,
        args.output_file,
    )
    return 0
