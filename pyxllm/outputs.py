"""What the engine returns for a request, shaped like vLLM's ``RequestOutput``."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class CompletionOutput:
    """One generated sequence of a request.

    ``text`` and ``token_ids`` are cumulative (everything generated so far); while streaming,
    ``text`` only ever grows, so a delta is ``text[len(previous_text):]``. ``finish_reason`` is
    ``None`` until the sequence finishes, then ``"stop"`` (EOS, stop string or stop token),
    ``"length"`` (max_tokens or the context limit) or ``"abort"``. ``stop_reason`` is the
    matched stop string or stop token id, ``None`` for EOS or when not stopped.
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: str | int | None = None


@dataclass(slots=True)
class RequestOutput:
    """The state of one request after an engine step: its prompt and its outputs."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
