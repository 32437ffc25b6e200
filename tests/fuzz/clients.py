"""Sending the fuzz corpus (:func:`run_cases`), the load test's streaming clients and its slow
and broken raw-socket clients, and what the tests read off a server (memory, idle, tracebacks)."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from tests.fuzz.cases import CHAT_PATH, COMPLETIONS_PATH, JSON_HEADERS, Case
from tests.fuzz.checks import check_case, choice_text, strict_json

# --- sending ------------------------------------------------------------------------------------


@dataclass
class Result:
    """What the server answered a case, and what is wrong with it."""

    case: Case
    status: int | None
    problems: list[str]
    seconds: float
    excerpt: bytes = b""


async def _chunks(body: bytes, size: int = 1 << 20):
    for start in range(0, len(body), size):
        yield body[start : start + size]


async def send_case(
    client: httpx.AsyncClient, case: Case, timeout: float = 60.0
) -> tuple[int | None, httpx.Headers | None, bytes, str | None]:
    """``(status, headers, body, transport error)`` of one case."""
    content = _chunks(case.body) if case.chunked and case.body else case.body
    try:
        request = client.build_request(
            case.method, case.path, content=content, headers=case.headers, timeout=timeout
        )
        response = await client.send(request, stream=True)
        try:
            body = await response.aread()
        finally:
            await response.aclose()
        return response.status_code, response.headers, body, None
    except httpx.HTTPError as exc:
        return None, None, b"", f"{type(exc).__name__}: {exc}"
    except Exception as exc:  # noqa: BLE001 - a case the client cannot send: the corpus's bug
        return None, None, b"", f"the client could not send it: {type(exc).__name__}: {exc}"


async def run_cases(
    base_url: str,
    cases: list[Case],
    concurrency: int = 12,
    timeout: float = 60.0,
    references: dict[bytes, str] | None = None,
    deadline: float | None = None,
    on_result: Callable[[Result], None] | None = None,
    skip_reason: str = "the time budget ran out",
) -> list[Result]:
    """Send ``cases`` ``concurrency`` at a time over keep-alive connections and judge each
    answer; cases not started by ``deadline`` (``time.monotonic()``) are skipped."""
    results: list[Result] = []
    queue: asyncio.Queue[Case] = asyncio.Queue()
    for case in cases:
        queue.put_nowait(case)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)

    async def worker(client: httpx.AsyncClient) -> None:
        while not queue.empty():
            case = queue.get_nowait()
            if deadline is not None and time.monotonic() > deadline:
                results.append(Result(case, None, [f"not sent: {skip_reason}"], 0.0))
                continue
            start = time.monotonic()
            status, headers, body, error = await send_case(client, case, timeout)
            problems = check_case(case, status, headers, body, error, references)
            result = Result(case, status, problems, time.monotonic() - start, body[:300])
            results.append(result)
            if on_result is not None:
                on_result(result)

    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=timeout) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    return results


async def compute_references(base_url: str, cases: list[Case]) -> dict[bytes, str]:
    """The greedy text of each distinct reference body of ``cases``, one request at a time."""
    references: dict[bytes, str] = {}
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:
        for case in cases:
            if case.reference is None or case.reference in references:
                continue
            response = await client.post(case.path, content=case.reference, headers=JSON_HEADERS)
            response.raise_for_status()
            references[case.reference] = choice_text(case.kind, response.json()["choices"][0])
    return references


def summarize(results: list[Result], seed: int, base_url: str, limit: int = 40) -> str:
    """The failures of ``results``, one paragraph each (its case, its repro and the problems),
    grouped by label and first problem, most frequent first."""
    failed = [r for r in results if r.problems]
    groups: dict[tuple[str, str], list[Result]] = {}
    for result in failed:
        first = result.problems[0]
        key = (result.case.label.split(":")[0], first[:60])
        groups.setdefault(key, []).append(result)
    lines = [
        f"{len(failed)} of {len(results)} requests failed (seed {seed}; rerun with "
        f"PYXLLM_FUZZ_SEED={seed}, only some with PYXLLM_FUZZ_CASES=<ids>), "
        f"{len(groups)} kinds:"
    ]
    for (_, _), members in sorted(groups.items(), key=lambda kv: -len(kv[1]))[:limit]:
        result = members[0]
        ids = ",".join(str(r.case.id) for r in members[:20])
        lines.append(f"\n* {len(members)}x, ids {ids}: {result.case.describe(400)}")
        lines.append(f"  expected {result.case.expect.describe()}; got {result.status}")
        for problem in result.problems[:3]:
            lines.append(f"  - {problem[:700]}")
        lines.append(f"  repro: {result.case.repro(base_url)[:1500]}")
    return "\n".join(lines)


# --- load: many streaming clients ----------------------------------------------------------------


@dataclass
class StreamOutcome:
    """One streaming client: its request, the text it read, whether it hung up early."""

    kind: str
    body: dict
    text: str = ""
    chunks: int = 0
    hung_up: bool = False
    problems: list[str] = field(default_factory=list)
    status: int | None = None


async def stream_client(
    client: httpx.AsyncClient, kind: str, body: dict, hang_up_after: int | None
) -> StreamOutcome:
    """Stream ``body`` to its end, or hang up after ``hang_up_after`` content chunks."""
    outcome = StreamOutcome(kind, body)
    path = CHAT_PATH if kind == "chat" else COMPLETIONS_PATH
    try:
        async with client.stream("POST", path, json={**body, "stream": True}) as response:
            outcome.status = response.status_code
            if response.status_code != 200:
                outcome.problems.append(
                    f"status {response.status_code}: {await response.aread()!r:.300}"
                )
                return outcome
            raw = b""
            async for line in response.aiter_lines():
                raw += line.encode() + b"\n"
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = strict_json(line[len("data: ") :])
                if "error" in chunk:
                    outcome.problems.append(f"error event {line[:300]}")
                for choice in chunk.get("choices") or []:
                    delta = choice.get("delta", {}).get("content") if kind == "chat" else None
                    outcome.text += (delta if kind == "chat" else choice.get("text")) or ""
                outcome.chunks += 1
                if hang_up_after is not None and outcome.chunks >= hang_up_after:
                    outcome.hung_up = True
                    return outcome  # leaving the block closes the connection
            if not raw.rstrip().endswith(b"data: [DONE]"):
                outcome.problems.append(f"stream did not end with [DONE]: {raw[-200:]!r}")
    except (httpx.HTTPError, ValueError) as exc:
        outcome.problems.append(f"{type(exc).__name__}: {exc}")
    return outcome


# --- slow and broken clients (raw sockets) -------------------------------------------------------


def _request_head(path: str, length: int | None, host: str, extra: str = "") -> bytes:
    head = f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
    if length is not None:
        head += f"Content-Length: {length}\r\n"
    return (head + extra + "\r\n").encode()


async def _read_status(reader: asyncio.StreamReader, timeout: float) -> int | None:
    """The status of the response on ``reader``, ``None`` if the server closed without one."""
    line = await asyncio.wait_for(reader.readline(), timeout)
    if not line:
        return None
    parts = line.split()
    return int(parts[1]) if len(parts) >= 2 and parts[1].isdigit() else None


async def trickled_body(
    host: str, port: int, body: bytes, step: int = 3, interval: float = 0.2
) -> tuple[int | None, bytes]:
    """Send a request whose body comes ``step`` bytes every ``interval`` seconds; return the
    status and the response's first bytes."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(_request_head(COMPLETIONS_PATH, len(body), f"{host}:{port}"))
        await writer.drain()
        for start in range(0, len(body), step):
            writer.write(body[start : start + step])
            await writer.drain()
            await asyncio.sleep(interval)
        status = await _read_status(reader, 60)
        rest = await asyncio.wait_for(reader.read(2000), 60)
        return status, rest
    finally:
        writer.close()


async def short_body_then_close(host: str, port: int, declared: int, sent: bytes) -> None:
    """Declare ``declared`` body bytes, send ``sent`` (fewer), then close the socket."""
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(_request_head(COMPLETIONS_PATH, declared, f"{host}:{port}") + sent)
    await writer.drain()
    await asyncio.sleep(0.2)
    writer.close()


async def short_body_then_half_close(
    host: str, port: int, declared: int, sent: bytes, timeout: float = 10.0
) -> int | None:
    """Declare ``declared`` body bytes, send ``sent``, shut the write side and wait for an
    answer: its status, ``None`` when the server just closes, -1 when it does neither within
    ``timeout`` seconds."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(_request_head(COMPLETIONS_PATH, declared, f"{host}:{port}") + sent)
        await writer.drain()
        writer.write_eof()
        try:
            return await _read_status(reader, timeout)
        except (ConnectionError, asyncio.IncompleteReadError):
            return None
        except asyncio.TimeoutError:
            return -1  # neither an answer nor a close
    finally:
        writer.close()


def idle_sockets(host: str, port: int, count: int, partial: bool) -> list[socket.socket]:
    """``count`` open connections that send nothing (or, with ``partial``, half a request
    head)."""
    sockets = []
    for _ in range(count):
        sock = socket.create_connection((host, port), timeout=10)
        if partial:
            sock.sendall(f"POST {COMPLETIONS_PATH} HTTP/1.1\r\nHost: {host}\r\n".encode())
        sockets.append(sock)
    return sockets


def unread_stream(host: str, port: int, body: dict) -> socket.socket:
    """Open a streaming request and never read it (a small receive buffer, so that the server's
    writes soon block); the caller closes the socket."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(10)
    sock.connect((host, port))
    data = json.dumps({**body, "stream": True}).encode()
    sock.sendall(_request_head(COMPLETIONS_PATH, len(data), f"{host}:{port}") + data)
    return sock


def server_rss_mb(pid: int) -> float:
    """The resident memory of process ``pid``, in MiB (``VmRSS`` of ``/proc/<pid>/status``)."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def wait_idle(base_url: str, timeout: float = 15.0) -> dict:
    """Poll ``/debug/stats`` until nothing runs or waits and no KV block is used (aborts settle
    asynchronously); return the last stats (the caller asserts on them)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            stats = httpx.get(base_url + "/debug/stats", timeout=5).json()
        except httpx.HTTPError as exc:
            stats = {"error": repr(exc)}
        if is_idle(stats) or time.monotonic() > deadline:
            return stats
        time.sleep(0.1)


def is_idle(stats: dict) -> bool:
    """Nothing running or waiting, no KV block used."""
    return (
        stats.get("num_running") == 0
        and stats.get("num_waiting") == 0
        and stats.get("num_kv_blocks_used") == 0
    )


def server_tracebacks(log: str, limit: int = 8) -> list[str]:
    """The distinct tracebacks (by their last pyxllm frame and exception type) in a server's
    output, the last ``limit``, each cut to pyxllm's own frames and the exception."""
    blocks: dict[str, str] = {}
    lines = log.splitlines()
    i = 0
    while i < len(lines):
        if not lines[i].startswith("Traceback (most recent call last)"):
            i += 1
            continue
        j = i + 1
        frames = []
        while j < len(lines) and (lines[j].startswith((" ", "\t")) or not lines[j].strip()):
            if "/pyxllm/" in lines[j] and lines[j].lstrip().startswith("File "):
                code = lines[j + 1].strip() if j + 1 < len(lines) else ""
                frames.append(f"{lines[j].strip()}: {code}")
            j += 1
        exception = lines[j] if j < len(lines) else "?"
        key = f"{frames[-1] if frames else ''} {exception.split(':')[0]}"
        blocks.pop(key, None)
        blocks[key] = "\n".join([*frames[-6:], exception[:500]])
        i = j + 1
    return list(blocks.values())[-limit:]
