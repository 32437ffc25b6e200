"""The synchronous engine: requests in, one scheduler step at a time, request outputs out."""

from __future__ import annotations

import logging
import time
from concurrent.futures import FIRST_COMPLETED
from concurrent.futures import wait as wait_for_futures

from pyxllm.config import DEFAULT_MAX_TOKENS_PER_BATCH, EngineConfig
from pyxllm.engine.detokenizer import IncrementalDetokenizer
from pyxllm.engine.errors import ConstraintFailedError, InvalidRequestError
from pyxllm.engine.frontend import EngineFrontend
from pyxllm.engine.input_processor import EngineRequest
from pyxllm.engine.kv_cache_manager import KVCacheManager
from pyxllm.engine.kv_connector import KVTierConnector
from pyxllm.engine.logprobs import record_logprobs
from pyxllm.engine.metrics import EngineMetrics
from pyxllm.engine.parallel_sampling import ParentRequest, fold_children
from pyxllm.engine.proposers import DraftModelSlots, NgramProposer
from pyxllm.engine.request import Request, RequestStatus
from pyxllm.engine.scheduler import Scheduler
from pyxllm.engine.structured_output import GrammarHandle
from pyxllm.engine.structured_output.manager import GRAMMAR_COMPILE_TIMEOUT_S
from pyxllm.engine.thinking_budget import forced_token_bitmask
from pyxllm.executor.abstract import Executor
from pyxllm.executor.factory import build_executor
from pyxllm.executor.scheduler_output import SchedulerOutput
from pyxllm.lora_request import LoRARequest
from pyxllm.outputs import CompletionOutput, PoolingOutput, PoolingRequestOutput, RequestOutput
from pyxllm.platforms import resolve_platform, set_current_platform
from pyxllm.pooling_params import POOLING_TASKS
from pyxllm.sampling_params import SamplingParams

logger = logging.getLogger("pyxllm")

# Longest wait of a step that has nothing to run but requests whose grammar compiles (seconds).
GRAMMAR_POLL_S = 0.01


class LLMEngine:
    """Loads a model and runs continuous batching over it, one ``step()`` at a time.

    With ``--task embed`` (or ``auto`` on an encoder) the requests are embedding requests
    (:meth:`InputProcessor.process_pooling`), scheduled as generation requests are, each a
    whole prompt in one step (no chunked prefill, no prefix cache: an encoder's attention is
    bidirectional, so no prefix of a prompt is computed alone, and mean pooling needs every
    token's hidden state in the step), run by the
    :class:`~pyxllm.executor.pooling_executor.PoolingExecutor` (an encoder) or by the
    ``ModelExecutor`` with a pooler (a decoder such as Qwen3-Embedding, on the paged KV cache);
    each finishes in the step that computes it, with a :class:`PoolingRequestOutput`.

    Raises (at construction):
        ValueError: a bad flag value, a model that cannot be found or loaded (``ModelLoadError``),
            an unsupported architecture.
    """

    def __init__(self, config: EngineConfig) -> None:
        platform = resolve_platform(config.device)  # a missing device package fails first
        platform.check_runner(config.graph_backend)
        front = EngineFrontend.load(config)
        # the task resolved for the model (--task auto), and embed's settings
        self.config = config = front.config
        self.max_model_len, self.tokenizer = front.max_model_len, front.tokenizer
        self.served_model_names, self.model_name = front.served_model_names, front.model_name
        set_current_platform(platform)
        # one process's UniprocExecutor, or under tensor parallelism rank 0's MultiprocExecutor
        self.executor: Executor = build_executor(config, front.model_config, front.source, platform)
        self.kv_cache_manager = KVCacheManager(
            self.executor.num_kv_blocks,
            config.block_size,
            enable_prefix_cache=config.enable_prefix_cache,
        )
        # an embedding model has no grammar to follow
        self.structured_outputs = (
            None if config.task in POOLING_TASKS else front.structured_output_manager()
        )
        self.input_processor = front.input_processor(
            self.executor.num_kv_blocks, self.structured_outputs
        )
        self.kv_connector = KVTierConnector.from_config(
            config, front, self.executor, self.kv_cache_manager
        )
        budget = config.token_budget(self.max_model_len)
        self.scheduler = Scheduler(
            config,
            self.kv_cache_manager,
            self.max_model_len,
            # Gemma 3's images: no prefill chunk may end inside one (see the scheduler)
            bidirectional_images=getattr(
                self.executor.driver.model, "bidirectional_image_attention", False
            ),
        )
        if config.max_tokens_per_batch is None and budget > DEFAULT_MAX_TOKENS_PER_BATCH:
            logger.info(
                "without chunked prefill a whole prompt is computed in one step: up to %d tokens "
                "a step (--max-model-len; --max-tokens-per-batch sets it)",
                budget,
            )
        self.speculative = config.speculative
        self.proposer = None if self.speculative is None else self._make_proposer(config)
        self.metrics = EngineMetrics(
            self.model_name, self.scheduler, self.kv_cache_manager, self.kv_connector
        )
        self.requests: dict[str, Request] = {}
        self.parents: dict[str, ParentRequest] = {}  # n > 1: parent id -> its children's outputs
        self.failed: dict[str, Exception] = {}  # see _fail
        # request id -> (request, its compiling grammar): see add_request
        self.waiting_for_grammar: dict[str, tuple[EngineRequest, GrammarHandle]] = {}
        self._parent_of: dict[str, ParentRequest] = {}  # child id -> parent
        if config.task in POOLING_TASKS:
            logger.info(
                "model %s, task %s: up to %d sequences of at most %d tokens a step",
                self.model_name,
                config.task,
                config.max_seqs_per_batch,
                self.max_model_len,
            )
            return
        max_concurrency = self.executor.num_kv_blocks * config.block_size / self.max_model_len
        logger.info(
            "model %s, dtype %s, device %s, %d KV blocks of %d tokens, max %.2fx concurrent "
            "sequences of %d tokens",
            self.model_name,
            str(self.executor.dtype).removeprefix("torch."),
            platform.name,
            self.executor.num_kv_blocks,
            config.block_size,
            max_concurrency,
            self.max_model_len,
        )

    def _make_proposer(self, config: EngineConfig) -> NgramProposer | DraftModelSlots:
        """The draft proposer of ``--speculative-config`` (for a draft model: the slots it
        fills in the executor)."""
        spec = self.speculative
        name = self.executor.driver.runner.name  # --graph-backend as resolved ("auto": its pick)
        runner = (
            "the graph runner replays each verification as 1 + k decode rows per sequence"
            if name == "graph"
            else f"runner {name}"
        )
        logger.info(
            "speculative decoding: %s, %d tokens, off above %d running sequences; %s",
            spec.method if spec.model is None else f"draft model {spec.model}",
            spec.num_speculative_tokens,
            spec.disable_by_batch_size,
            runner,
        )
        if spec.method == "draft_model":
            return DraftModelSlots(spec.num_speculative_tokens)
        return NgramProposer(
            spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max
        )

    def add_request(self, request: EngineRequest) -> None:
        """Queue a request processed by :attr:`input_processor` (trusted: nothing is checked
        again); it joins the batch at the next step.

        With ``n > 1`` the request runs as ``n`` children (see
        :mod:`pyxllm.engine.parallel_sampling`) whose outputs come back as one ``RequestOutput``
        under ``request_id``.

        A request with a constraint waits, before joining the scheduler, until its grammar has
        compiled (vLLM's ``WAITING_FOR_FSM``): the compile runs on the grammar threads and
        :meth:`step` admits the request once it is done, so adding never blocks. The server and
        ``LLM`` have compiled the constraint before (to answer a bad one at once), and in the
        same process this finds it compiled; a data-parallel replica compiles it here.

        Raises:
            ValueError: the ``request_id`` is already in use.
            InvalidRequestError: the request's constraint does not compile (when that is known
                at once; later, :meth:`pop_failures` holds the error).
        """
        request_id = request.request_id
        if request_id in self.requests or request_id in self.parents:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if request.lora_request is not None:
            self.add_lora(request.lora_request)
        if request_id in self.waiting_for_grammar:
            raise ValueError(f"request_id {request_id!r} is already in use")
        spec = request.sampling_params.structured_outputs
        if spec is None or request.pooling_params is not None:
            self._admit(request, None)
            return
        grammar = self.structured_outputs.submit(spec)
        if not grammar.done():
            self.waiting_for_grammar[request_id] = (request, grammar)
            return
        grammar.compiled(timeout=0)  # raises when it did not compile
        self._admit(request, grammar)

    def _admit_compiled(self) -> None:
        """Admit the requests whose grammar has compiled since the last step; one whose grammar
        did not compile, or not within ``GRAMMAR_COMPILE_TIMEOUT_S`` of its arrival, fails
        (:meth:`pop_failures`)."""
        now = time.monotonic()
        for request_id, (request, grammar) in list(self.waiting_for_grammar.items()):
            late = now - request.arrival_time > GRAMMAR_COMPILE_TIMEOUT_S
            if not (grammar.done() or late):
                continue
            del self.waiting_for_grammar[request_id]
            try:
                if not grammar.done():
                    raise grammar.timeout_error(GRAMMAR_COMPILE_TIMEOUT_S)
                grammar.compiled(timeout=0)
            except InvalidRequestError as exc:
                self.failed[request_id] = exc
                continue
            self._admit(request, grammar)

    def _admit(self, request: EngineRequest, grammar: GrammarHandle | None) -> None:
        """Hand a request (its grammar compiled, if it has one) to the scheduler: as one
        request, or as ``n`` children."""
        request_id, params = request.request_id, request.sampling_params
        if params.n == 1:
            self._add_child(request_id, request, params, grammar)
            return
        parent = ParentRequest(request_id, request.prompt, request.prompt_token_ids, params)
        self.parents[request_id] = parent
        for index, child_id in enumerate(parent.child_ids):
            self._parent_of[child_id] = parent
            self._add_child(child_id, request, parent.child_params(index), grammar, index)

    def _add_child(
        self,
        request_id: str,
        request: EngineRequest,
        params: SamplingParams,
        grammar: GrammarHandle | None,
        index: int = 0,
    ) -> None:
        if request.pooling_params is not None:  # prefill only: nothing to detokenize or stop
            pooled = Request(
                request_id,
                request.prompt,
                list(request.prompt_token_ids),
                params,
                None,
                arrival_time=request.arrival_time,
                pooling_params=request.pooling_params,
            )
            self.requests[request_id] = pooled
            self.scheduler.add_request(pooled)
            return
        detokenizer = IncrementalDetokenizer(
            self.tokenizer,
            request.prompt_token_ids,
            skip_special_tokens=params.skip_special_tokens,
            stop=params.stop,
            include_stop_str_in_output=params.include_stop_str_in_output,
            min_tokens=params.min_tokens,
        )
        min_tokens_stop_ids = ()
        if params.min_tokens > 0:
            eos = () if params.ignore_eos else self.tokenizer.eos_token_ids
            min_tokens_stop_ids = tuple(sorted({*eos, *params.stop_token_ids}))
        child = Request(
            request_id,
            request.prompt,
            list(request.prompt_token_ids),
            params,
            detokenizer,
            arrival_time=request.arrival_time,
            index=index,
            min_tokens_stop_ids=min_tokens_stop_ids,
            lora_request=request.lora_request,
            mm_features=request.mm_features,
        )
        if grammar is not None:
            child.matcher = grammar.new_matcher()
            child.constrain_after = request.constrain_after
        self.requests[request_id] = child
        self.scheduler.add_request(child)

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load a LoRA adapter into the model (``False``: loaded already); requests name it by
        their ``lora_request`` (vLLM's ``add_lora``).

        Raises:
            ValueError: the engine runs without ``--enable-lora``, or on an executor that
                cannot take adapters; ``LoRAAdapterError`` (a ``ValueError``) for an adapter it
                cannot serve, naming it.
        """
        driver = getattr(self.executor, "driver", None)
        if driver is None or not hasattr(driver, "add_lora"):
            raise ValueError("LoRA adapters need --enable-lora on a one-rank engine")
        return driver.add_lora(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Drop a loaded LoRA adapter (``False`` when it was not loaded); requests that still
        name it read it again from its directory."""
        driver = getattr(self.executor, "driver", None)
        return (
            driver is not None
            and hasattr(driver, "remove_lora")
            and driver.remove_lora(lora_int_id)
        )

    def abort_request(self, request_id: str) -> None:
        """Stop a request (every child of an ``n > 1`` one) now and free its KV blocks (unknown
        ids are ignored)."""
        self.waiting_for_grammar.pop(request_id, None)
        parent = self.parents.pop(request_id, None)
        for child_id in parent.child_ids if parent is not None else ():
            self._parent_of.pop(child_id, None)
            self.abort_request(child_id)
        request = self.requests.pop(request_id, None)
        if self.kv_connector is not None:
            self.kv_connector.drop(request_id)
        if request is not None:
            if self.kv_connector is not None:
                self.kv_connector.cancel(request, self.scheduler)
            self.scheduler.finish_request(request, RequestStatus.FINISHED_ABORTED)
            self.metrics.record_finished(request, time.monotonic())

    def shutdown(self) -> None:
        """Stop the executor's TP workers, if any, and the grammar compile threads; idempotent."""
        if self.structured_outputs is not None:
            self.structured_outputs.shutdown()
        if self.kv_connector is not None:
            self.kv_connector.close()
        self.executor.shutdown()

    def has_unfinished_requests(self) -> bool:
        connector = self.kv_connector
        loading = connector is not None and bool(connector.loading or connector.held)
        return bool(self.waiting_for_grammar) or loading or self.scheduler.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        """Run one scheduler step; returns the outputs of requests that got a token this step.
        With nothing to run but requests waiting for their grammar, it waits for one to compile
        (at most :data:`GRAMMAR_POLL_S`) rather than return at once, so a loop stepping an
        engine that waits does not spin."""
        if self.waiting_for_grammar:
            self._admit_compiled()
        if self.kv_connector is not None:
            self.kv_connector.load(self.scheduler)
        plan = self.scheduler.schedule()
        if not plan.sequences:
            if self.waiting_for_grammar:
                pending = [grammar.future for _, grammar in self.waiting_for_grammar.values()]
                wait_for_futures(pending, GRAMMAR_POLL_S, return_when=FIRST_COMPLETED)
            elif self.kv_connector is not None:
                self.kv_connector.wait_for_loads(GRAMMAR_POLL_S)
            return [] if self.kv_connector is None else self.kv_connector.hold([])
        broken = self._constrain(plan)  # (request, exception) of each that failed its step
        result = self.executor.execute(plan)
        if self.kv_connector is not None:
            self.kv_connector.save()
        if result.pooled is not None:
            return self._finish_pooled(plan, result.pooled)
        outputs, now = [], time.monotonic()
        if result.logprobs is not None or result.prompt_logprobs is not None:
            broken += record_logprobs(self.requests, plan, result, self.tokenizer.decode_each)
        for seq, tokens in zip(plan.sequences, result.sampled_token_ids):
            if seq.num_draft_tokens:
                self.metrics.record_spec_decode(seq.num_draft_tokens, len(tokens) - 1)
        new_tokens = self.scheduler.update_from_output(result.sampled_token_ids)
        if self.kv_connector is not None:
            live = (self.requests.get(seq.request_id) for seq in plan.sequences)
            self.kv_connector.push([request for request in live if request is not None])
        self.metrics.record_tokens(new_tokens, now)
        for request, exc in broken:
            if not request.status.finished:  # failed once already
                self._fail(request, exc)
        for request, tokens in new_tokens:
            if request.status.finished:  # failed above
                continue
            try:
                status = self._process_tokens(request, tokens)
                if status is not None:
                    self.scheduler.finish_request(request, status)
                    self.metrics.record_finished(request, now)
                    del self.requests[request.request_id]
                outputs.append(self._make_output(request))
            except Exception as exc:  # noqa: BLE001 - one request's failure is its own
                self._fail(request, exc)
        if self.proposer is not None:
            self._propose_drafts()
        if self.kv_connector is not None and not self.scheduler.has_unfinished_requests():
            self.kv_connector.flush()  # idle: what it answered is on disk
        if self.parents:
            outputs = fold_children(outputs, self.parents, self._parent_of)
        return outputs if self.kv_connector is None else self.kv_connector.hold(outputs)

    def _finish_pooled(self, plan: SchedulerOutput, pooled: list) -> list[PoolingRequestOutput]:
        """End each embedding request of an embed step with its pooled vector (``pooled[i]``
        for ``plan.sequences[i]``, each a whole prompt) and free its blocks."""
        self.scheduler.update_from_output([[] for _ in plan.sequences])
        outputs, now = [], time.monotonic()
        for seq, vector in zip(plan.sequences, pooled):
            request = self.requests.pop(seq.request_id)
            self.scheduler.finish_request(request, RequestStatus.FINISHED_STOPPED)
            self.metrics.record_pooled(request, now)
            outputs.append(
                PoolingRequestOutput(
                    request.request_id,
                    request.prompt,
                    request.prompt_token_ids,
                    PoolingOutput(vector),
                )
            )
        return outputs

    def _process_tokens(self, request: Request, tokens: list[int]) -> RequestStatus | None:
        """Feed a request's new tokens (already appended) to its constraint and stop rules, one
        by one; at a stop the tokens after it are dropped (with their logprobs), so speculation
        never emits past an EOS, a stop string, ``max_tokens`` or the context limit.

        Raises:
            ConstraintFailedError: a token the request's constraint does not allow (the
                sampler's mask should have made that impossible).
        """
        first = request.num_tokens - len(tokens)  # where tokens[0] is in token_ids
        for i, token in enumerate(tokens):
            if not request.accept_token(first + i):
                reason = request.matcher.error()
                raise ConstraintFailedError(
                    f"structured output failed: the sampled token {token} broke the "
                    "request's constraint" + (f" ({reason})" if reason else "")
                )
            num_output = first + i + 1 - request.num_prompt_tokens
            status = self._check_stop(request, token, num_output)
            if status is not None:
                del request.token_ids[first + i + 1 :]
                if request.logprobs is not None:
                    del request.logprobs[num_output:]
                return status
        return None

    def _propose_drafts(self) -> None:
        """Give each decoding request its drafts for the next step (speculative decoding), unless
        more sequences run than ``disable_by_batch_size``. A constrained request's drafts stop
        at the first its constraint refuses (:meth:`Request.allowed_drafts`; the draft model's
        are made in the executor, after this point, so constrained requests get none from it);
        no draft goes past ``max_tokens`` or the context limit."""
        running = self.scheduler.running
        if len(running) > self.speculative.disable_by_batch_size:
            for request in running:  # a request skipped last step still holds its drafts
                request.spec_token_ids = []
            return
        drafts_in_executor = isinstance(self.proposer, DraftModelSlots)
        for request in running:
            if request.num_computed_tokens != request.num_tokens - 1:
                continue
            if request.matcher is not None and drafts_in_executor:
                continue
            room = min(
                request.max_tokens - request.num_output_tokens,
                self.max_model_len - request.num_tokens,
            )
            thinking_room = request.thinking_room()  # drafts stop where the budget forces
            if thinking_room is not None:
                room = min(room, thinking_room)
            drafts = self.proposer.propose(request.token_ids, room - 1)
            request.spec_token_ids = request.allowed_drafts(drafts)

    def _fail(self, request: Request, exc: Exception) -> None:
        """End a request whose own processing raised (its detokenizer, matcher ...): abort it
        (all of an ``n > 1`` request's children), free its blocks, and keep ``exc`` in
        :attr:`failed` under the id its caller knows, for :meth:`pop_failures`."""
        request_id = self._parent_of.get(request.request_id, request.request_id)
        logger.error("request %s failed", request_id, exc_info=exc)
        self.abort_request(request_id)
        self.failed[request_id] = exc
        self.metrics.record_failed(
            "constraint" if isinstance(exc, ConstraintFailedError) else "other"
        )

    def pop_failures(self) -> dict[str, Exception]:
        """The requests that failed since the last call (request id -> the exception); they
        are no longer in the engine and get no further output."""
        failed, self.failed = self.failed, {}
        return failed

    def _constrain(self, plan: SchedulerOutput) -> list[tuple[Request, Exception]]:
        """Give each sampling sequence with a constraint the bitmask of its allowed tokens
        (a request whose thinking budget is spent: the end of its reasoning alone, see
        :mod:`~pyxllm.engine.thinking_budget`); returns the requests whose constraint the
        grammar library failed on, with a :class:`ConstraintFailedError` each (their rows
        allow EOS alone for this step)."""
        rows, manager, failed = [], self.structured_outputs, []
        for seq in plan.sequences:
            request = self.requests[seq.request_id] if seq.sample else None
            if request is None:
                continue
            forced = request.forced_token() if request.thinking is not None else None
            if forced is not None:  # drafts stop before forcing (_propose_drafts): none here
                seq.allowed_token_bitmask = forced_token_bitmask(
                    forced, self.input_processor.vocab_size
                )
                continue
            if not request.constrained:
                continue
            if not seq.num_draft_tokens:
                rows.append((seq, request))
                continue
            try:  # one row per verified position
                seq.allowed_token_bitmask = manager.fill_draft_bitmask(
                    request.matcher, seq.draft_token_ids
                )
            except Exception as exc:  # noqa: BLE001 - one request's grammar is its own
                seq.allowed_token_bitmask = manager.eos_rows(1 + seq.num_draft_tokens)
                failed.append((request, _grammar_failed(exc)))
        if rows:
            bitmask, failures = manager.fill_bitmask([request.matcher for _, request in rows])
            for (seq, _), row in zip(rows, bitmask):
                seq.allowed_token_bitmask = row
            failed += [(rows[i][1], _grammar_failed(exc)) for i, exc in failures.items()]
        return failed

    def _check_stop(self, request: Request, token: int, num_output: int) -> RequestStatus | None:
        """Apply the stop rules to a request's new token, its ``num_output``-th output token,
        in vLLM's order."""
        params = request.sampling_params
        may_stop = num_output > params.min_tokens  # the sampler masked them before
        if may_stop and token in self.tokenizer.eos_token_ids and not params.ignore_eos:
            self._finish_on_token(request, token)
            return RequestStatus.FINISHED_STOPPED
        if may_stop and token in params.stop_token_ids:
            request.stop_reason = token
            self._finish_on_token(request, token)
            return RequestStatus.FINISHED_STOPPED
        stop = request.detokenizer.update([token])
        if stop is not None:
            request.stop_reason = stop
            return RequestStatus.FINISHED_STOPPED
        if (
            num_output >= request.max_tokens
            or request.num_prompt_tokens + num_output >= self.max_model_len
        ):
            request.detokenizer.finish()
            return RequestStatus.FINISHED_LENGTH
        return None

    @staticmethod
    def _finish_on_token(request: Request, token: int) -> None:
        """End the text on an EOS or stop token: its text is kept only with
        ``include_stop_str_in_output`` (and then only if not a skipped special token)."""
        if request.sampling_params.include_stop_str_in_output:
            request.detokenizer.update([token])
        request.detokenizer.finish()

    @staticmethod
    def _make_output(request: Request) -> RequestOutput:
        completion = CompletionOutput(
            index=request.index,
            text=request.detokenizer.output_text,
            token_ids=request.output_token_ids,
            finish_reason=request.finish_reason,
            stop_reason=request.stop_reason,
            logprobs=None if request.logprobs is None else list(request.logprobs),
        )
        return RequestOutput(
            request.request_id,
            request.prompt,
            request.prompt_token_ids,
            [completion],
            request.status.finished,
            request.prompt_logprobs,
            request.prompt_logprobs_tensor(),
            request.num_cached_tokens,
        )

    def stats(self) -> dict[str, int | float]:
        """Scheduler and KV cache counters (for /debug/stats); a cached block that no live
        request references is not counted in ``num_kv_blocks_used``."""
        kv = self.kv_cache_manager
        return {
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting)
            + len(self.waiting_for_grammar)
            + (0 if self.kv_connector is None else len(self.kv_connector.loading)),
            "num_kv_blocks_total": kv.num_blocks,
            "num_kv_blocks_used": kv.num_used_blocks,
            "num_preemptions": self.scheduler.num_preemptions,
            "prefix_cache_queries": kv.num_queries,
            "prefix_cache_hits": kv.num_hits,
            "spec_decode_num_drafts": self.metrics.num_spec_drafts,
            "spec_decode_num_draft_tokens": self.metrics.num_spec_draft_tokens,
            "spec_decode_num_accepted_tokens": self.metrics.num_spec_accepted,
            **({} if self.kv_connector is None else self.kv_connector.stats()),
        }


def _grammar_failed(exc: Exception) -> ConstraintFailedError:
    """The request's error when the grammar library raised ``exc`` for its constraint."""
    error = ConstraintFailedError(
        "structured output failed: the grammar library could not compute the allowed tokens "
        f"({type(exc).__name__})"
    )
    error.__cause__ = exc
    return error
