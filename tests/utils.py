"""Test helpers: :class:`RemoteServer` runs ``pyxllm serve`` as a real subprocess."""

from __future__ import annotations

import os
import shutil
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


def tool_calling_server_args(model: str) -> list[str]:
    """Flags of a server on the default model under ``model``, as the tool-calling,
    Responses and Messages tests start it: no tool flags, as ``tool_choice: "auto"`` works
    with the parser chosen from the chat template (hermes' for the default model)."""
    return ["--served-model-name", model, "--max-model-len", "2048", "--kv-cache-memory", "0.25"]


class RemoteServer:
    """``python -m pyxllm serve --port <free port> *args`` in a subprocess.

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
            "pyxllm",
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


def kill_mid_stream(
    server: RemoteServer, kill, error_match: str, model: str = "tp", exit_timeout: float = 15.0
) -> list[str]:
    """Stream a long completion from ``server``, call ``kill()`` once its first chunk arrives
    (e.g. kill a tensor-parallel worker), and check that the stream then fails before its end
    with an error matching ``error_match``; then poll ``GET /health`` until the server exits (at
    most ``exit_timeout`` seconds). Returns the error messages of the 503 answers seen."""
    import openai
    import pytest

    chunks, max_tokens = 0, 240
    stream = server.openai_client().completions.create(
        model=model, prompt="Count:", max_tokens=max_tokens, temperature=0, stream=True
    )
    with pytest.raises(openai.APIError, match=error_match):
        for _ in stream:
            chunks += 1
            if chunks == 1:  # mid-run
                kill()
    assert chunks < max_tokens
    unhealthy, deadline = [], time.monotonic() + exit_timeout
    while server.proc.poll() is None and time.monotonic() < deadline:
        try:
            response = httpx.get(server.url_for("health"), timeout=1)
            if response.status_code == 503:
                unhealthy.append(response.json()["error"]["message"])
        except httpx.HTTPError:  # the server is closing
            pass
        time.sleep(0.1)
    return unhealthy


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
        task="generate",
        tokenizer=SimpleNamespace(hf=None),
    )
    return TestClient(build_app(engine, ServerOptions(**options)))


class RayCluster:
    """A Ray cluster of this test's own on this machine: ``ray start --head --block`` and, with
    :meth:`add_node`, more ``ray start --address HEAD --block`` processes (each a "node" with its
    own CPUs and custom resources), all in a temp dir and on ports of their own, so stopping it
    ends these processes only (never ``ray stop``, which ends every Ray process on the machine).

    Use as a context manager; the test process joins it as a driver (``ray.init``) and leaves it
    on exit. Usage stats are off, there is no dashboard, and each node's object store is small.

    Attributes:
        address: the head's ``host:port`` (``--ray-address``).
        env: the environment the nodes run with (servers joining the cluster should get it too).
    """

    OBJECT_STORE_BYTES = 100 * 2**20
    START_TIMEOUT_S = 90.0

    def __init__(self, num_cpus: int, resources: dict[str, float] | None = None):
        self.num_cpus, self.resources = num_cpus, resources or {}
        self.temp_dir = tempfile.mkdtemp(prefix="pyxllm-ray-", dir="/tmp")  # short: socket paths
        # Ray's token authentication off, as `ray start` has it without a token: said for every
        # process, or a ~/.ray/auth_token (which a local `ray.init()` writes) would turn it on
        # for some of them (the token mode is read when Ray is imported, too early to set here)
        self.auth = {"RAY_AUTH_MODE": "disabled"}
        self.env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "PYTHONUNBUFFERED": "1"}
        self.env.update(self.auth)
        self.env.pop("RAY_ADDRESS", None)
        self._saved_env = {k: os.environ.get(k) for k in self.auth}
        self.procs: list[subprocess.Popen] = []
        self.address = f"127.0.0.1:{free_port()}"

    def _start(self, args: list[str], num_cpus: int, resources: dict[str, float]) -> None:
        import json

        ray = os.path.join(os.path.dirname(sys.executable), "ray")
        log = open(os.path.join(self.temp_dir, f"node{len(self.procs)}.log"), "wb")  # noqa: SIM115
        self.procs.append(
            subprocess.Popen(
                [ray, "start", "--block", *args, "--num-cpus", str(num_cpus)]
                + ["--resources", json.dumps(resources)]
                + ["--object-store-memory", str(self.OBJECT_STORE_BYTES)]
                + ["--dashboard-agent-listen-port", str(free_port())],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,  # its own process group, to end it whole
            )
        )
        log.close()

    def _wait_nodes(self, count: int) -> None:
        import ray

        deadline = time.monotonic() + self.START_TIMEOUT_S
        while len([n for n in ray.nodes() if n["Alive"]]) < count:
            if any(p.poll() is not None for p in self.procs) or time.monotonic() > deadline:
                raise RuntimeError(f"Ray nodes did not start:\n{self.logs()[-4000:]}")
            time.sleep(0.2)

    def __enter__(self) -> RayCluster:
        import ray

        os.environ.update(self.auth)  # this process joins as a driver
        port = self.address.rpartition(":")[2]
        self._start(
            ["--head", "--port", port, "--temp-dir", self.temp_dir, "--include-dashboard=false"]
            + ["--dashboard-port", str(free_port()), "--disable-usage-stats"],
            self.num_cpus,
            self.resources,
        )
        try:
            deadline = time.monotonic() + self.START_TIMEOUT_S
            while True:  # ray.init would wait for a head that died: wait for its port first
                try:
                    socket.create_connection(("127.0.0.1", int(port)), timeout=1).close()
                    break
                except OSError:
                    if self.procs[0].poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"Ray head did not start:\n{self.logs()}") from None
                    time.sleep(0.2)
            ray.init(address=self.address, logging_level="warning")
            self._wait_nodes(1)
        except BaseException:
            self.stop()
            raise
        return self

    def add_node(self, num_cpus: int, resources: dict[str, float]) -> None:
        """Start one more node (``ray start --address``) and wait until the cluster has it."""
        self._start(["--address", self.address, "--temp-dir", self.temp_dir], num_cpus, resources)
        self._wait_nodes(len(self.procs))

    def logs(self) -> str:
        """What the ``ray start`` processes printed."""
        out = []
        for i in range(len(self.procs)):
            with open(os.path.join(self.temp_dir, f"node{i}.log"), "rb") as f:
                out.append(f.read().decode(errors="replace"))
        return "\n".join(out)

    def stop(self) -> None:
        """Leave the cluster, SIGTERM every node (each drains and ends its own processes), kill
        what is left of their process groups, and delete the temp dir."""
        import ray

        ray.shutdown()
        for key, value in self._saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # workers left behind, if any
            except ProcessLookupError:
                pass
            proc.wait(timeout=10)
        shutil.rmtree(self.temp_dir, ignore_errors=True)  # the nodes' logs and sockets

    def __exit__(self, *exc_info) -> None:
        self.stop()
