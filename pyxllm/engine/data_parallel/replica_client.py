"""The API server's view of one data-parallel replica (:class:`ReplicaClient`: its channel,
its process, its scrapes) and of a request running on one (:class:`InFlightRequest`: the whole
output rebuilt from the deltas the replica streams); :mod:`.client` drives both."""

from __future__ import annotations

import dataclasses
import itertools
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field

from pyxllm.distributed.ray_utils import describe_node
from pyxllm.engine.async_engine import RequestStream
from pyxllm.engine.data_parallel.launcher import ReplicaHandle
from pyxllm.engine.data_parallel.wire import Channel, ReadyMessage, ScrapeMessage, ScrapeReply
from pyxllm.engine.errors import EngineDeadError
from pyxllm.engine.input_processor import EngineRequest
from pyxllm.outputs import CompletionOutput, PoolingRequestOutput, RequestOutput


class ReplicaClient:
    """One replica as the API server sees it: its channel, its process and what it said.

    Attributes:
        index: the replica's number.
        handle: its :class:`~.launcher.ReplicaHandle`.
        pid: its process id (from its hello).
        ready: its :class:`~.wire.ReadyMessage` (KV blocks, threads, CPUs).
        failure: ``None`` while it serves, else why it stopped ("data-parallel replica 1
            (pid 4242) died (killed by SIGKILL)"; with Ray the pid's node too, see
            :meth:`describe`).
    """

    def __init__(self, index: int, handle: ReplicaHandle, channel: Channel, pid: int) -> None:
        self.index, self.handle, self.channel, self.pid = index, handle, channel, pid
        self.ready: ReadyMessage | None = None
        self.failure: str | None = None
        self.last_words: str | None = None  # a DeadMessage's reason, before the end-of-file
        self._scrapes: dict[int, Future] = {}
        self._seq = itertools.count()
        self._lock = threading.Lock()

    def describe(self) -> str:
        """``data-parallel replica 1 (pid 4242)``, with Ray ``(pid 4242, Ray actor on node
        3f2a91c0 at 10.0.0.2)``."""
        node = self.handle.node()
        where = f", Ray actor on {describe_node(node)}" if node else ""
        return f"data-parallel replica {self.index} (pid {self.pid}{where})"

    @property
    def alive(self) -> bool:
        """Whether the replica is in rotation (it has not died or been stopped)."""
        return self.failure is None

    def send(self, message: object) -> None:
        """Send a message.

        Raises:
            EngineDeadError: the replica is gone.
        """
        if self.failure is not None:
            raise EngineDeadError(self.failure)
        try:
            self.channel.send(message)
        except OSError as exc:
            raise EngineDeadError(f"data-parallel replica {self.index} is gone ({exc})") from exc

    def start_scrape(self) -> Future:
        """Ask for the replica's stats and metrics; the future resolves to its
        :class:`~.wire.ScrapeReply`, or raises :class:`EngineDeadError`."""
        future: Future = Future()
        with self._lock:
            seq = next(self._seq)
            self._scrapes[seq] = future
        try:
            self.send(ScrapeMessage(seq))
        except EngineDeadError as exc:
            self.resolve_scrape(seq, exc)
        return future

    def resolve_scrape(self, seq: int, reply: ScrapeReply | BaseException) -> None:
        """Hand scrape ``seq`` its reply (or the error ending it); a scrape given up on is
        ignored."""
        with self._lock:
            future = self._scrapes.pop(seq, None)
        if future is None:
            return
        if isinstance(reply, BaseException):
            future.set_exception(reply)
        else:
            future.set_result(reply)

    def fail_scrapes(self, exc: BaseException) -> None:
        """End every scrape still waiting with ``exc`` (the replica is gone)."""
        with self._lock:
            pending, self._scrapes = self._scrapes, {}
        for future in pending.values():
            future.set_exception(exc)


@dataclass(slots=True)
class InFlightRequest:
    """A request running on a replica, and its outputs so far (by completion index)."""

    request: EngineRequest
    replica: int
    stream: RequestStream
    completions: dict[int, CompletionOutput] = field(default_factory=dict)
    first: RequestOutput | None = None

    @property
    def weight(self) -> int:
        """What the request counts in its replica's load: its samples."""
        return self.request.sampling_params.n

    def merge(
        self, delta: RequestOutput | PoolingRequestOutput
    ) -> RequestOutput | PoolingRequestOutput:
        """The whole output a replica's delta (see :class:`~.wire.OutputsMessage`) stands
        for: each completion's earlier text, tokens and logprobs with the new ones appended,
        the prompt and the first output's prompt logprobs put back (a pooling request's one
        output: its prompt put back)."""
        if isinstance(delta, PoolingRequestOutput):
            return dataclasses.replace(
                delta, prompt=self.request.prompt, prompt_token_ids=self.request.prompt_token_ids
            )
        merged = []
        for new in delta.outputs:
            old = self.completions.get(new.index)
            if old is not None:
                new = CompletionOutput(
                    new.index,
                    old.text + new.text,
                    old.token_ids + new.token_ids,
                    new.finish_reason,
                    new.stop_reason,
                    None if new.logprobs is None else old.logprobs + new.logprobs,
                )
            self.completions[new.index] = new
            merged.append(new)
        first = self.first = self.first or delta
        return RequestOutput(
            delta.request_id,
            self.request.prompt,
            self.request.prompt_token_ids,
            merged,
            delta.finished,
            first.prompt_logprobs,
            first.prompt_logprobs_tensor,
            delta.num_cached_tokens,
        )
