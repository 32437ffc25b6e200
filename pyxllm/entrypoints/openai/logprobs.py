"""The engine's per-token :class:`~pyxllm.outputs.Logprob` dicts in OpenAI's two shapes.

Chat: ``{"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}``.
Completions: ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``. A logprob of a
token the sampling settings ruled out (``-inf``) is sent as -9999.0, as vLLM does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from pyxllm.entrypoints.openai.protocol import (
    ChatCompletionLogProb,
    ChatCompletionLogProbs,
    ChatCompletionLogProbsContent,
    CompletionLogProbs,
)
from pyxllm.outputs import Logprob

MIN_LOGPROB = -9999.0


def _value(logprob: float) -> float:
    """The logprob as sent: at least MIN_LOGPROB (NaN, which cannot be in JSON, too)."""
    return logprob if logprob >= MIN_LOGPROB else MIN_LOGPROB


def _text(entry: Logprob) -> str:
    return entry.decoded_token or ""


def _top(entries: dict[int, Logprob], num_top: int) -> list[tuple[int, Logprob]]:
    """The ``num_top`` most likely ``(token id, entry)`` pairs, by rank."""
    ranked = sorted(
        ((t, e) for t, e in entries.items() if e.rank is not None and e.rank <= num_top),
        key=lambda pair: pair[1].rank,
    )
    return ranked[:num_top]


def chat_logprobs(
    token_ids: Sequence[int],
    logprobs: Sequence[dict[int, Logprob]],
    num_top: int,
    token_bytes: Callable[[int], bytes],
) -> ChatCompletionLogProbs:
    """Chat ``logprobs`` of generated ``token_ids`` (one dict each) with ``num_top``
    alternatives; ``token_bytes`` gives each token's ``bytes`` (see
    :meth:`pyxllm.engine.tokenizer.Tokenizer.token_bytes`)."""
    content = []
    for token_id, entries in zip(token_ids, logprobs):
        chosen = entries[token_id]
        top = [
            ChatCompletionLogProb(
                token=_text(e), logprob=_value(e.logprob), bytes=list(token_bytes(top_id))
            )
            for top_id, e in _top(entries, num_top)
        ]
        content.append(
            ChatCompletionLogProbsContent(
                token=_text(chosen),
                logprob=_value(chosen.logprob),
                bytes=list(token_bytes(token_id)),
                top_logprobs=top,
            )
        )
    return ChatCompletionLogProbs(content=content)


def completion_logprobs(
    token_ids: Sequence[int],
    logprobs: Sequence[dict[int, Logprob] | None],
    num_top: int,
    initial_offset: int = 0,
    decode_each=None,
) -> CompletionLogProbs:
    """Completion ``logprobs`` of ``token_ids``: one dict each, or ``None`` (the first prompt
    token with ``echo``, whose text then comes from ``decode_each``); offsets count from
    ``initial_offset`` characters (the text already sent before these tokens)."""
    out = CompletionLogProbs()
    offset = initial_offset
    missing = [t for t, e in zip(token_ids, logprobs) if e is None]
    missing_text = dict(zip(missing, decode_each(missing))) if missing and decode_each else {}
    for token_id, entries in zip(token_ids, logprobs):
        if entries is None:
            text, value, top = missing_text.get(token_id, ""), None, None
        else:
            chosen = entries[token_id]
            text, value = _text(chosen), _value(chosen.logprob)
            top = {_text(e): _value(e.logprob) for _, e in _top(entries, num_top)}
            top.setdefault(text, value)
        out.tokens.append(text)
        out.token_logprobs.append(value)
        out.top_logprobs.append(top)
        out.text_offset.append(offset)
        offset += len(text)
    return out
