"""Continuous batching: which requests compute which tokens in the next step.

One token budget per step (``--max-tokens-per-batch``) is spent on running requests first
(decodes, or the next chunk of a partly prefilled prompt), then on admitting waiting requests,
in arrival order, up to ``--max-seqs-per-batch`` running sequences. With chunked prefill a prompt
longer than what is left of the budget is split across steps (vLLM v1's unified scheduling:
a request simply has ``num_tokens - num_computed_tokens`` tokens left to compute). When KV
blocks run out, the most recently admitted running request is preempted: its blocks are freed
and it waits to be recomputed, keeping the tokens it generated. A waiting request (new or
preempted) starts after its prefix-cache hit (see ``KVCacheManager.get_computed_blocks``).

Images (vision-language models): a step also has an encoder budget, as vLLM v1's scheduler
(``max_num_encoder_input_tokens``, by default the step's token budget): the placeholder tokens
of the images whose runs begin in the step's chunks, each distinct image counted once. A chunk
that would pass it ends just before the image that does (the request goes on next step), so
one step never encodes more images than that; the first image of a step always fits, so an
image larger than the budget still runs.

A model that attends bidirectionally within each image (``bidirectional_images``: Gemma 3,
whose image tokens see their whole image) must never have a prefill chunk end inside an image:
its earlier tokens would miss the later ones. vLLM's ``disable_chunked_mm_input`` rule: a
chunk that would cut an image stops before it (the request goes on next step); a chunk that
starts inside or at an image (its first part a prefix-cache hit, which was computed with the
whole image in view) takes the image's rest in one piece, or waits for the next step when the
budget left cannot hold it; a rest larger than the whole step budget runs alone in a step,
over the budget. Each scheduled sequence names the images whose tokens see later ones
(``ScheduledSequence.bidirectional_ranges``), from which the attention masks are built.

Speculative decoding: a decoding request with draft tokens (``Request.spec_token_ids``) computes
its last token and the drafts in one step (vLLM v1's way): ``1 + k`` query tokens, KV slots for
all of them. The executor returns the tokens the target model accepted plus its own next one;
the request advances past the accepted ones only, and blocks allocated just for rejected drafts
are freed.
"""

from __future__ import annotations

from collections import deque

from pyxllm.config import EngineConfig
from pyxllm.engine.kv_cache_manager import KVCacheManager
from pyxllm.engine.request import Request, RequestStatus
from pyxllm.executor.scheduler_output import ScheduledSequence, SchedulerOutput


class Scheduler:
    """Holds the waiting queue and the running list; plans steps and records their results.

    Each step computes at most ``config.token_budget(max_model_len)`` tokens
    (``--max-tokens-per-batch``; without chunked prefill and without that flag, enough for a
    whole ``max_model_len`` prompt). ``bidirectional_images``: the model attends bidirectionally
    within each image (see the module docstring).
    """

    def __init__(
        self,
        config: EngineConfig,
        kv_cache_manager: KVCacheManager,
        max_model_len: int | None = None,
        bidirectional_images: bool = False,
    ) -> None:
        self.max_seqs = config.max_seqs_per_batch
        self.max_loras = config.max_loras
        self.max_tokens = config.token_budget(max_model_len)
        self.encoder_budget = self.max_tokens  # placeholder tokens of images begun per step
        self.chunked_prefill = config.enable_chunked_prefill
        self.bidirectional_images = bidirectional_images
        self.kv = kv_cache_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        # (request, tokens computed this step, of which speculative drafts)
        self._scheduled: list[tuple[Request, int, int]] = []

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
        request.spec_token_ids = []
        request.status, request.num_computed_tokens = RequestStatus.WAITING, 0
        self.waiting.appendleft(request)
        self.num_preemptions += 1

    def schedule(self) -> SchedulerOutput:
        """Plan the next step. Every returned sequence has its KV slots allocated."""
        budget, scheduled, preempted = self.max_tokens, [], False
        encoder = _EncoderBudget(self.encoder_budget)
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = request.num_tokens - request.num_computed_tokens
            drafts = len(request.spec_token_ids) if num_new == 1 else 0
            num_new = min(num_new + drafts, budget)
            drafts = min(drafts, num_new - 1)
            if request.mm_features:
                start = request.num_computed_tokens
                num_new = encoder.fit(request, start, num_new)
                if self.bidirectional_images:
                    num_new = self._whole_images(request, start, num_new, budget)
                if num_new == 0:  # its next image waits for the next step
                    i += 1
                    continue
            while not self.kv.allocate_slots(request, num_new, num_draft_tokens=drafts):
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
            else:
                scheduled.append((request, num_new, drafts))
                budget -= num_new
                i += 1
        # at most max_loras distinct adapters run at once: a request on another one waits,
        # keeping its place, while the requests behind it may go (vLLM's rule)
        adapters = {r.lora_request.lora_int_id for r in self.running if r.lora_request}
        skipped: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_seqs and not preempted:
            request = self.waiting[0]
            lora = request.lora_request
            if lora and lora.lora_int_id not in adapters and len(adapters) >= self.max_loras:
                skipped.append(self.waiting.popleft())
                continue
            hits = [] if request.needs_prompt_logprobs else self.kv.get_computed_blocks(request)
            num_cached = len(hits) * self.kv.block_size
            num_new = request.num_tokens - num_cached
            if num_new > budget and not self.chunked_prefill:
                break
            num_new = min(num_new, budget)
            if request.mm_features:
                fitted = encoder.fit(request, num_cached, num_new)
                if self.bidirectional_images and fitted:
                    fitted = self._whole_images(request, num_cached, fitted, budget)
                if fitted < num_new and (fitted == 0 or not self.chunked_prefill):
                    break  # its image waits for the next step, and the queue behind it
                num_new = fitted
            if not self.kv.allocate_slots(request, num_new, hits):
                break
            self.waiting.popleft()
            request.num_computed_tokens = num_cached
            if request.num_cached_tokens is None:
                request.num_cached_tokens = num_cached
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append((request, num_new, 0))
            budget -= num_new
            if lora:
                adapters.add(lora.lora_int_id)
        self.waiting.extendleft(reversed(skipped))
        self._scheduled = scheduled
        return SchedulerOutput([self._to_sequence(r, n, d) for r, n, d in scheduled])

    def _whole_images(self, request: Request, start: int, num_new: int, budget: int) -> int:
        """How many of the ``num_new`` tokens from ``start`` ``request`` computes this step so
        that its chunk ends inside no image (see the module docstring); ``budget``: the tokens
        left in the step. 0: it waits for the next step."""
        end = start + num_new
        for feature in request.mm_features:
            lo, hi = feature.mm_position.offset, feature.mm_position.end
            if not lo < end < hi:
                continue
            if lo > start:
                return lo - start  # stop before the image
            # the chunk starts inside or at the image: its rest in one piece, alone in a step
            # when it is larger than the step budget
            return hi - start if budget >= self.max_tokens else 0
        return num_new

    def _bidirectional_ranges(self, request: Request, start: int, end: int):
        """The ``[start, end)`` positions of ``request``'s images whose tokens in ``[start,
        end)`` see later tokens of their image (``ScheduledSequence.bidirectional_ranges``)."""
        ranges = []
        for feature in request.mm_features:
            part = feature.overlap(start, end)
            if part is not None and part[0] < feature.mm_position.end - 1:
                ranges.append((feature.mm_position.offset, feature.mm_position.end))
        return tuple(ranges)

    def _to_sequence(self, request: Request, num_new: int, num_drafts: int) -> ScheduledSequence:
        start, params = request.num_computed_tokens, request.sampling_params
        num_real = num_new - num_drafts
        num_output = request.num_output_tokens
        targets = None
        if request.needs_prompt_logprobs:
            targets = (
                request.token_ids[start + 1 : min(start + num_new + 1, request.num_prompt_tokens)]
                or None
            )
        return ScheduledSequence(
            request_id=request.request_id,
            token_ids=request.token_ids[start : start + num_real]
            + request.spec_token_ids[:num_drafts],
            num_computed_tokens=start,
            block_table=self.kv.get_block_table(request),
            sample=start + num_real == request.num_tokens,
            num_draft_tokens=num_drafts,
            sampling_params=params,
            generator=request.generator,
            num_output_tokens=num_output,
            min_tokens_stop_ids=request.min_tokens_stop_ids
            if num_output < params.min_tokens
            else (),
            penalty_token_ids=request.token_ids if params.uses_penalties else None,
            num_prompt_tokens=request.num_prompt_tokens,
            prompt_logprob_targets=targets,
            pooling_params=request.pooling_params,
            lora_request=request.lora_request,
            mm_features=request.mm_features_in(start, start + num_real)
            if request.mm_features
            else [],
            mrope_positions=request.mrope_positions_in(start, start + num_new)
            if request.mm_features
            else None,
            bidirectional_ranges=self._bidirectional_ranges(request, start, start + num_real)
            if request.mm_features and self.bidirectional_images
            else (),
        )

    def update_from_output(
        self, sampled_token_ids: list[list[int]]
    ) -> list[tuple[Request, list[int]]]:
        """Advance each scheduled request past its computed tokens and append its new ones.

        ``sampled_token_ids[i]``: the tokens sequence ``i`` got (empty: none; with ``k`` drafts,
        the accepted drafts then the target's next token). Returns ``(request, new tokens)`` for
        every request that got some.
        """
        new_tokens = []
        for (request, num_new, num_drafts), tokens in zip(self._scheduled, sampled_token_ids):
            request.spec_token_ids = []
            rejected = num_drafts - (len(tokens) - 1) if num_drafts else 0
            request.num_computed_tokens += num_new - rejected
            if tokens:
                request.token_ids.extend(tokens)
                new_tokens.append((request, tokens))
            if rejected:
                self.kv.trim(request, request.num_tokens)
        self._scheduled = []
        return new_tokens


class _EncoderBudget:
    """One step's encoder budget (see the module docstring): placeholder tokens of the images
    whose runs begin in the step's chunks, each distinct image (content hash) counted once."""

    def __init__(self, tokens: int) -> None:
        self.left = tokens
        self.images: set[str] = set()

    def fit(self, request: Request, start: int, num_new: int) -> int:
        """How many of the ``num_new`` tokens from ``start`` ``request`` computes this step: up
        to the first image beginning in them that passes the budget (all when none does),
        its images counted."""
        for feature in request.mm_features:
            offset = feature.mm_position.offset
            if not start <= offset < start + num_new or feature.identifier in self.images:
                continue
            cost = feature.mm_position.length
            if cost > self.left and self.images:
                return offset - start
            self.images.add(feature.identifier)
            self.left -= cost
        return num_new
