"""Continuous batching: which requests compute which tokens in the next step.

One token budget per step (``--max-tokens-per-batch``) is spent on running requests first
(decodes, or the next chunk of a partly prefilled prompt), then on admitting waiting requests,
in arrival order, up to ``--max-seqs-per-batch`` running sequences. With chunked prefill a prompt
longer than what is left of the budget is split across steps (vLLM v1's unified scheduling:
a request simply has ``num_tokens - num_computed_tokens`` tokens left to compute). When KV
blocks run out, the most recently admitted running request is preempted: its blocks are freed
and it waits to be recomputed, keeping the tokens it generated. A waiting request (new or
preempted) starts after its prefix-cache hit (see ``KVCacheManager.get_computed_blocks``).
"""

from __future__ import annotations

from collections import deque

from pyxllm.config import EngineConfig
from pyxllm.engine.kv_cache_manager import KVCacheManager
from pyxllm.engine.request import Request, RequestStatus
from pyxllm.executor.scheduler_output import ScheduledSequence, SchedulerOutput


class Scheduler:
    """Holds the waiting queue and the running list; plans steps and records their results."""

    def __init__(self, config: EngineConfig, kv_cache_manager: KVCacheManager) -> None:
        self.max_seqs = config.max_seqs_per_batch
        self.max_tokens = config.max_tokens_per_batch
        self.chunked_prefill = config.enable_chunked_prefill
        self.kv = kv_cache_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self._scheduled: list[tuple[Request, int]] = []

    def add_request(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def finish_request(self, request: Request, status: RequestStatus) -> None:
        """Mark ``request`` finished with ``status``, drop it from the queues and free its
        blocks."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        request.status = status
        self.kv.free(request)

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.status, request.num_computed_tokens = RequestStatus.WAITING, 0
        self.waiting.appendleft(request)
        self.num_preemptions += 1

    def schedule(self) -> SchedulerOutput:
        """Plan the next step. Every returned sequence has its KV slots allocated."""
        budget, scheduled, preempted = self.max_tokens, [], False
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            while not self.kv.allocate_slots(request, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
            else:
                scheduled.append((request, num_new))
                budget -= num_new
                i += 1
        while self.waiting and budget > 0 and len(self.running) < self.max_seqs and not preempted:
            request = self.waiting[0]
            hits = [] if request.needs_prompt_logprobs else self.kv.get_computed_blocks(request)
            num_cached = len(hits) * self.kv.block_size
            num_new = request.num_tokens - num_cached
            if num_new > budget and not self.chunked_prefill:
                break
            num_new = min(num_new, budget)
            if not self.kv.allocate_slots(request, num_new, hits):
                break
            self.waiting.popleft()
            request.num_computed_tokens = num_cached
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append((request, num_new))
            budget -= num_new
        self._scheduled = scheduled
        return SchedulerOutput([self._to_sequence(r, n) for r, n in scheduled])

    def _to_sequence(self, request: Request, num_new: int) -> ScheduledSequence:
        start, params = request.num_computed_tokens, request.sampling_params
        num_output = request.num_output_tokens
        targets = None
        if request.needs_prompt_logprobs:
            targets = (
                request.token_ids[start + 1 : min(start + num_new + 1, request.num_prompt_tokens)]
                or None
            )
        return ScheduledSequence(
            request_id=request.request_id,
            token_ids=request.token_ids[start : start + num_new],
            num_computed_tokens=start,
            block_table=self.kv.get_block_table(request),
            sample=start + num_new == request.num_tokens,
            sampling_params=params,
            generator=request.generator,
            num_output_tokens=num_output,
            min_tokens_stop_ids=request.min_tokens_stop_ids
            if num_output < params.min_tokens
            else (),
            penalty_token_ids=request.token_ids if params.uses_penalties else None,
            num_prompt_tokens=request.num_prompt_tokens,
            prompt_logprob_targets=targets,
        )

    def update_from_output(self, sampled_token_ids: list[int | None]) -> list[tuple[Request, int]]:
        """Advance each scheduled request past its computed tokens and append sampled tokens.

        Returns ``(request, new_token_id)`` for every request that got a token this step.
        """
        new_tokens = []
        for (request, num_new), token in zip(self._scheduled, sampled_token_ids):
            request.num_computed_tokens += num_new
            if token is not None:
                request.token_ids.append(token)
                new_tokens.append((request, token))
        self._scheduled = []
        return new_tokens
