"""Test helpers: :class:`RemoteServer` runs ``pyxllm serve`` as a real subprocess."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from types import SimpleNamespace

import httpx
from fastapi.testclient import TestClient

from pyxllm.entrypoints.openai.api_server import build_app
from pyxllm.entrypoints.openai.server_options import ServerOptions


def free_port() -> int:
    """A TCP port that is free on 127.0.0.1 right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RemoteServer:
    """``python -m pyxllm.entrypoints.cli serve --port <free port> *args`` in a subprocess.

    Use as a context manager: entering waits until ``GET /health`` answers 200 (failing at
    once, with the server's output, if the process exits first); leaving sends SIGTERM, then
    kills the process if it has not exited within ``stop_timeout`` seconds.

    Attributes:
        host, port: where it listens.
        base_url: ``http://host:port/v1``, for the OpenAI SDK.
    """

    def __init__(
        self,
        args: list[str],
        startup_timeout: float = 120.0,
        stop_timeout: float = 20.0,
        env: dict[str, str] | None = None,
    ):
        self.host = "127.0.0.1"
        self.port = free_port()
        self.args = [
            sys.executable,
            "-m",
            "pyxllm.entrypoints.cli",
            "serve",
            "--host",
            self.host,
            "--port",
            str(self.port),
            *args,
        ]
        self.startup_timeout = startup_timeout
        self.stop_timeout = stop_timeout
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.proc: subprocess.Popen | None = None
        self._log = None

    @property
    def base_url(self) -> str:
        """The OpenAI API root, ``http://host:port/v1``."""
        return f"http://{self.host}:{self.port}/v1"

    def url_for(self, *parts: str) -> str:
        """``url_for("v1", "models")`` -> ``http://host:port/v1/models``."""
        path = "/".join(p.strip("/") for p in parts)
        return f"http://{self.host}:{self.port}/{path}"

    def openai_client(self, **kwargs):
        """An ``openai.OpenAI`` client for this server (no retries: errors surface at once)."""
        import openai

        kwargs.setdefault("max_retries", 0)
        kwargs.setdefault("timeout", 120.0)
        return openai.OpenAI(base_url=self.base_url, api_key="EMPTY", **kwargs)

    def output(self) -> str:
        """Everything the server wrote to stdout and stderr so far."""
        if self._log is None:
            return ""
        self._log.flush()
        self._log.seek(0)
        return self._log.read().decode(errors="replace")

    def __enter__(self) -> RemoteServer:
        self._log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            self.args, stdout=self._log, stderr=subprocess.STDOUT, env=self.env
        )
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        url = self.url_for("health")
        while True:
            code = self.proc.poll()
            if code is not None:
                raise RuntimeError(
                    f"server exited with status {code} before it was healthy:\n"
                    f"{self.output()[-8000:]}"
                )
            try:
                if httpx.get(url, timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"server not healthy after {self.startup_timeout:.0f} s:\n"
                    f"{self.output()[-8000:]}"
                )
            time.sleep(0.25)

    def stop(self) -> int | None:
        """SIGTERM, then SIGKILL after ``stop_timeout``; returns the exit status."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=self.stop_timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        return self.proc.returncode


def run_together(*calls):
    """Call each of ``calls`` (no arguments) at the same time, each on its own thread, and
    return their results in order (re-raising the first exception). A server batches
    concurrent requests, so checking a streamed request against the same one unstreamed costs
    about one request's time, not two."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(calls)) as pool:
        futures = [pool.submit(call) for call in calls]
        return [future.result() for future in futures]


def stub_app_client(**options):
    """A ``TestClient`` of ``build_app`` with ``ServerOptions(**options)`` on a stand-in engine,
    for routes and middleware that answer before a request reaches the engine."""
    engine = SimpleNamespace(
        input_processor=SimpleNamespace(structured_outputs=None),
        model_name="m",
        served_model_names=("m",),
        max_model_len=8,
        max_num_seqs=1,
        data_parallel_size=1,
        tokenizer=SimpleNamespace(hf=None),
    )
    return TestClient(build_app(engine, ServerOptions(**options)))
