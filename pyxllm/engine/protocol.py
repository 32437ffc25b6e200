"""The seam between the API server and the engine it serves: :class:`EngineClient`.

The OpenAI layer (:mod:`pyxllm.entrypoints.openai`) uses an engine only through these members,
and two classes implement them: :class:`~pyxllm.engine.async_engine.AsyncEngine` (one engine
whose loop runs in a background thread) and
:class:`~pyxllm.engine.data_parallel.client.DataParallelEngine` (replicas in other processes
behind a router). vLLM's ``EngineClient`` (``vllm/engine/protocol.py``) draws the same line; a
``typing.Protocol`` rather than an abstract class lets a test hand the server a small stand-in.
``tests/test_architecture.py`` checks that the server reaches for nothing else and that both
classes provide every member.

Imports for annotations only, so that importing this module loads no torch.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from pyxllm.engine.input_processor import EngineRequest, InputProcessor
    from pyxllm.engine.tokenizer import Tokenizer
    from pyxllm.lora_request import LoRARequest
    from pyxllm.outputs import RequestOutput


class EngineMetrics(Protocol):
    """An engine's Prometheus metrics: what ``/metrics`` renders."""

    registry: CollectorRegistry


class EngineClient(Protocol):
    """What the API server uses of an engine (thread-safety: every method is called on the
    server's event loop, ``stats`` on a worker thread).

    Attributes:
        input_processor: turns a prompt and :class:`~pyxllm.sampling_params.SamplingParams`
            into a validated :class:`~pyxllm.engine.input_processor.EngineRequest`
            (thread-safe).
        tokenizer: the model's :class:`~pyxllm.engine.tokenizer.Tokenizer`.
        model_name: the name answers carry as ``model``; served_model_names: every name a
            request may give (the first is ``model_name``).
        max_model_len: the context length in tokens, prompt and output together.
        max_num_seqs: the most requests one engine runs at once (``--max-seqs-per-batch``).
        data_parallel_size: the number of engine replicas (1 for one engine).
        task: what the engine makes, ``generate`` (text) or ``embed`` (pooled vectors;
            ``--task``).
        metrics: the engine's Prometheus metrics.
        lora_requests: the LoRA adapters served (``--enable-lora``) by the name requests give
            as ``model``.
    """

    input_processor: InputProcessor
    tokenizer: Tokenizer
    model_name: str
    served_model_names: tuple[str, ...]
    max_model_len: int
    max_num_seqs: int
    data_parallel_size: int
    task: str
    metrics: EngineMetrics
    lora_requests: dict[str, LoRARequest]

    async def add_lora(self, lora_request: LoRARequest) -> None:
        """Load a LoRA adapter and serve it under its name.

        Raises:
            ValueError: no ``--enable-lora``, the name is served already, or the adapter
                cannot be served (``LoRAAdapterError``, naming it).
        """
        ...

    async def remove_lora(self, lora_name: str) -> None:
        """Stop serving a LoRA adapter (requests already running with it finish).

        Raises:
            KeyError: no adapter is served under that name.
        """
        ...

    def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """Run a processed request, yielding its output after every step that changed it (the
        last has ``finished=True``); closing the iterator early aborts the request.

        Raises:
            ValueError: the request id is in use, or the engine refused the request.
            RuntimeError: the engine died (``EngineDeadError``) or the request failed in it
                (``RequestFailedError``, ``ConstraintFailedError``).
        """
        ...

    def abort(self, request_id: str) -> None:
        """Abort a request (unknown ids are ignored); its KV blocks are freed soon after."""
        ...

    def check_health(self) -> None:
        """Return while the engine can serve; raise (naming the cause) when it cannot."""
        ...

    def fatal_error(self) -> str | None:
        """Why the engine can never serve again (the server then exits), else ``None``."""
        ...

    def fail_requests(self, reason: str) -> None:
        """End every open request with ``EngineDeadError(reason)``."""
        ...

    def health_detail(self) -> dict | None:
        """What ``/health`` shows beside its 200 when the engine serves but not fully, else
        ``None``."""
        ...

    def stats(self) -> dict:
        """The scheduler's and KV cache's counters (``/debug/stats``)."""
        ...

    def shutdown(self) -> None:
        """Stop the engine (its threads, workers or replicas); pending requests get an
        error."""
        ...
