"""Beam search as a loop above the engine (vLLM's design) with transformers' rules.

The engine knows nothing of beams. Each step, every live beam runs as a one-token request
(prompt: the beam's tokens; ``max_tokens=1``; ``logprobs=K``; greedy, so the logprobs are the
model's log-softmax), and :class:`BeamSearch` turns the ``K`` top logprobs of every live beam
into the next beams. The prefix cache makes this cheap: the beams of one prompt share its full KV
blocks, and a beam's next step finds its own earlier blocks cached, so each step computes at
most a block's worth of tokens per beam. :class:`~pyxllm.entrypoints.llm.LLM` drives the loop
synchronously (every prompt's beams in one batch per step), the server asynchronously
(:func:`run_beam_search`); the rules live here once. Pure logic: no torch.

The rules are those of transformers' ``generate(num_beams=W, do_sample=False)`` (5.x,
``GenerationMixin._beam_search``, with its default ``early_stopping=False``), so that the same
model gives the same sequences and scores; vLLM's loop cites transformers as its model but
simplifies three rules, and transformers is the reference the tests can compare with:

- Candidates: ``K = max(2, 1 + number of EOS ids) * W`` per step (transformers'
  ``beams_to_keep``; vLLM asks for ``2 * W``). Every live beam offers its own ``K`` most likely
  next tokens, scored by the beam's summed logprob plus the token's; the ``K`` best over all
  beams are kept, best first (a beam's own top ``K`` is enough: the overall top ``K`` is among
  them).
- A candidate that ends with an EOS id (unless ``ignore_eos``), or that reaches ``max_tokens``,
  is finished. It joins the finished sequences only if it ranks among the first ``W`` of the
  ``K`` (transformers; vLLM keeps every EOS candidate). The next live beams are the ``W`` best
  unfinished candidates.
- A finished sequence's score is its summed logprob divided by its length to the power
  ``length_penalty``, the length being the generated tokens *with* the EOS token (transformers
  since its beam search rewrite, transformers#35802: ``cur_len + 1 - prompt_len``; vLLM, like
  transformers' older ``BeamHypotheses``, leaves the EOS out). The ``W`` best scores are kept.
- The search stops when every candidate finished (``max_tokens`` reached), or by transformers'
  ``early_stopping=False`` test: once ``W`` sequences finished, when the best live beam's summed
  logprob divided by the current generated length to the power ``length_penalty`` is no better
  than the worst finished score (no more are added after that). vLLM always runs to
  ``max_tokens``; with ``length_penalty > 0`` transformers' test can stop before a longer beam
  would have scored better, and we stop where it does.
- The result: the ``W`` finished sequences, best first: transformers' ``sequences`` with
  ``num_return_sequences=W`` and their ``sequences_scores`` (:attr:`BeamSearchSequence.score`).

Ties between equal scores are broken by beam order, then by token rank within a beam
(``torch.topk`` leaves them unspecified).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from pyxllm.engine.input_processor import EngineRequest, TokensPrompt
from pyxllm.outputs import (
    BeamSearchOutput,
    BeamSearchSequence,
    CompletionOutput,
    Logprob,
    RequestOutput,
)
from pyxllm.sampling_params import MAX_LOGPROBS, BeamSearchParams, SamplingParams

if TYPE_CHECKING:
    from pyxllm.engine.protocol import EngineClient


def step_sampling_params(num_candidates: int) -> SamplingParams:
    """The parameters of one beam's one-token step: greedy, every model-defaultable field
    neutral (so the logprobs are the model's own log-softmax), ``num_candidates`` logprobs."""
    return SamplingParams(
        max_tokens=1,
        logprobs=num_candidates,
        temperature=0.0,
        top_p=1.0,
        top_k=-1,
        min_p=0.0,
        repetition_penalty=1.0,
        ignore_eos=True,
    )


class BeamSearch:
    """The beam search of one prompt, advanced one token at a time by its driver.

    Usage: while not :attr:`done`, run each of :meth:`pending` (token id lists) as a one-token
    request with :attr:`step_params`, and give :meth:`advance` each one's first-token logprobs
    in that order; then read :meth:`result`.

    Args:
        prompt_token_ids: the prompt.
        params: the search's :class:`BeamSearchParams`.
        eos_token_ids: the ids that end a sequence (the tokenizer's and the model's).

    Raises:
        ValueError: ``beam_width`` too large for the candidates it needs (``K`` above
            :data:`MAX_LOGPROBS`, with several EOS ids), naming ``beam_width``.
    """

    def __init__(
        self,
        prompt_token_ids: Sequence[int],
        params: BeamSearchParams,
        eos_token_ids: Iterable[int],
    ) -> None:
        self.params = params
        self.eos = frozenset() if params.ignore_eos else frozenset(eos_token_ids)
        self.num_candidates = max(2, 1 + len(self.eos)) * params.beam_width
        if self.num_candidates > MAX_LOGPROBS:
            raise ValueError(
                f"beam_width: {params.beam_width} beams with {len(self.eos)} EOS ids need "
                f"{self.num_candidates} candidates per step, more than {MAX_LOGPROBS}"
            )
        self.step_params = step_sampling_params(self.num_candidates)
        self.live = [BeamSearchSequence(list(prompt_token_ids))]
        self.finished: list[BeamSearchSequence] = []
        self.generated = 0
        self.improvable = True
        self.done = False

    def pending(self) -> list[list[int]]:
        """The token ids of each live beam, to run for one token (none once :attr:`done`)."""
        return [] if self.done else [beam.tokens for beam in self.live]

    def advance(self, step_logprobs: Sequence[dict[int, Logprob]]) -> None:
        """Take one step: ``step_logprobs[i]`` is the next-token logprobs of ``pending()[i]``
        (at least its top ``num_candidates``)."""
        width, k, penalty = self.params.beam_width, self.num_candidates, self.params.length_penalty
        length = self.generated + 1
        candidates = []
        for beam, logprobs in zip(self.live, step_logprobs, strict=True):
            top = sorted(logprobs.items(), key=lambda item: -item[1].logprob)[:k]
            candidates += [(beam.cum_logprob + lp.logprob, beam, t, logprobs) for t, lp in top]
        candidates.sort(key=lambda c: -c[0])
        candidates = candidates[:k]
        at_length = length >= self.params.max_tokens
        live, finished, all_finish = [], [], True
        for rank, (cum, beam, token, logprobs) in enumerate(candidates):
            grown = BeamSearchSequence(beam.tokens + [token], beam.logprobs + [logprobs], cum)
            if token in self.eos or at_length:
                if rank < width and self.improvable:
                    grown.score = cum / length**penalty
                    grown.finish_reason = "stop" if token in self.eos else "length"
                    grown.stop_reason = token if token in self.eos else None
                    finished.append(grown)
            else:
                all_finish = False
                if len(live) < width:
                    live.append(grown)
        self.finished = sorted(self.finished + finished, key=lambda s: -s.score)[:width]
        self.live, self.generated = live, length
        if len(self.finished) == width and self.improvable and live:
            best_possible = live[0].cum_logprob / length**penalty
            self.improvable = best_possible > self.finished[-1].score
        self.done = all_finish or not self.improvable

    def result(self, decode: Callable[[list[int]], str]) -> BeamSearchOutput:
        """The finished sequences, best first, each ``text`` set to ``decode(tokens)``."""
        sequences = [replace(s, text=decode(s.tokens)) for s in self.finished]
        return BeamSearchOutput(sequences)


def as_request_output(
    request: EngineRequest, search: BeamSearch, decode: Callable[[list[int], bool], str]
) -> RequestOutput:
    """A finished search as the finished :class:`RequestOutput` of ``request`` (what the server
    answers): one output per sequence, best first, holding the generated tokens (a finishing EOS
    included, as the engine counts it) and their text, the EOS's text only with
    ``include_stop_str_in_output``. ``decode(ids, skip_special_tokens)`` is the tokenizer's."""
    params, start = request.sampling_params, len(request.prompt_token_ids)
    outputs = []
    for index, seq in enumerate(search.finished):
        generated = seq.tokens[start:]
        shown = generated
        if seq.finish_reason == "stop" and not params.include_stop_str_in_output:
            shown = generated[:-1]
        text = decode(shown, params.skip_special_tokens)
        outputs.append(
            CompletionOutput(
                index, text, generated, seq.finish_reason, seq.stop_reason, seq.logprobs
            )
        )
    return RequestOutput(
        request.request_id, request.prompt, request.prompt_token_ids, outputs, finished=True
    )


async def run_beam_search(
    engine: EngineClient, request: EngineRequest, search: BeamSearch
) -> RequestOutput:
    """Run ``search`` (a new :class:`BeamSearch` of ``request``'s prompt) on ``engine``, each
    step's beams concurrently as requests ``<request_id>-beam<step>-<i>``; the finished output
    of :func:`as_request_output`. Cancelling it aborts the step's requests.

    Raises:
        ValueError: a step the engine refused.
        RuntimeError: the engine died or a step failed in it.
    """
    processor = engine.input_processor
    while not search.done:
        step = [
            processor.process(
                f"{request.request_id}-beam{search.generated}-{i}",
                TokensPrompt(tokens),
                search.step_params,
            )
            for i, tokens in enumerate(search.pending())
        ]
        tasks = [asyncio.ensure_future(_last_output(engine, r)) for r in step]
        try:
            outputs = await asyncio.gather(*tasks)
        except BaseException:
            for task, step_request in zip(tasks, step):
                task.cancel()
                engine.abort(step_request.request_id)
            raise
        search.advance([output.outputs[0].logprobs[0] for output in outputs])
    return as_request_output(request, search, engine.tokenizer.decode)


async def _last_output(engine: EngineClient, request: EngineRequest) -> RequestOutput:
    """The finished output of ``request``."""
    final = None
    async for output in engine.generate(request):
        final = output
    return final
