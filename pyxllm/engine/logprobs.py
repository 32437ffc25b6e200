"""Turning the executor's logprob lists into the per-token ``{token id: Logprob}`` dicts that
requests collect (:attr:`~pyxllm.engine.request.Request.logprobs` and ``prompt_logprobs``), and
collecting whole-vocabulary prompt rows (``prompt_logprob_rows``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from pyxllm.engine.request import Request
from pyxllm.executor.scheduler_output import SchedulerOutput
from pyxllm.outputs import Logprob

Decode = Callable[[Sequence[int]], list[str]]


def logprob_dict(
    token_ids: list[int], logprobs: list[float], rank: int, decode: Decode
) -> dict[int, Logprob]:
    """``token id -> Logprob`` of one position: the given token first (with its rank), then the
    top ones (rank 1, 2, ...); ``decode(ids)`` gives each token's text."""
    texts = decode(token_ids)
    entries = {token_ids[0]: Logprob(logprobs[0], rank, texts[0])}
    for r, (t, v, text) in enumerate(zip(token_ids[1:], logprobs[1:], texts[1:]), start=1):
        entries.setdefault(t, Logprob(v, r, text))
    return entries


def record_logprobs(
    requests: Mapping[str, Request], plan: SchedulerOutput, result, decode: Decode
) -> list[tuple[Request, Exception]]:
    """Append a step's sample logprobs (one per emitted token) and prompt logprobs (a
    ``StepResult``: per-token lists, or a ``float32 [rows, vocab_size]`` tensor for
    ``prompt_logprobs=-1``) to their requests; returns the requests whose logprobs could not be
    recorded (a decoder that raised), with the error, for the engine to fail alone.

    Call before the scheduler advances the requests: each sequence's ``num_computed_tokens``
    then still marks where its step started, which places prompt logprobs (a chunk recomputed
    after preemption is not appended twice).
    """
    failed = []
    for i, seq in enumerate(plan.sequences):
        request = requests.get(seq.request_id)
        if request is None:
            continue
        try:
            samples = result.logprobs[i] if result.logprobs is not None else None
            if samples is not None and request.logprobs is not None:
                request.logprobs.extend(logprob_dict(*sample, decode) for sample in samples)
            chunk = result.prompt_logprobs[i] if result.prompt_logprobs is not None else None
            if chunk is None or not request.needs_prompt_logprobs:
                continue
            skip = max(request.num_prompt_logprobs_recorded - (seq.num_computed_tokens + 1), 0)
            if isinstance(chunk, torch.Tensor):
                request.prompt_logprob_rows.append(chunk[skip:])
            else:
                request.prompt_logprobs.extend(logprob_dict(*e, decode) for e in chunk[skip:])
        except Exception as exc:  # noqa: BLE001 - one request's failure is its own
            failed.append((request, exc))
    return failed
