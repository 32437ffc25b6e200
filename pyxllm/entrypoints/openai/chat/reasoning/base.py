"""The interface of a reasoning parser, and the streaming logic every parser shares."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import NamedTuple


def find_token_ids(token_ids: Sequence[int], sub: Sequence[int]) -> int:
    """Where ``sub`` first occurs in ``token_ids``; -1 when it does not (or is empty)."""
    sub, n = list(sub), len(sub)
    for start in range(len(token_ids) - n + 1) if n else ():
        if list(token_ids[start : start + n]) == sub:
            return start
    return -1


class ReasoningSpans(NamedTuple):
    """Where reasoning and content lie in a text: ``text[reasoning_start:reasoning_end]`` and
    ``text[content_start:content_end]``; whatever lies outside both (tags, a held-back partial
    tag) is shown in neither field."""

    reasoning_start: int
    reasoning_end: int
    content_start: int
    content_end: int


class ReasoningDelta(NamedTuple):
    """What one streamed step adds to ``reasoning_content`` and to ``content`` (either may be
    empty)."""

    reasoning: str = ""
    content: str = ""


class ReasoningParser(ABC):
    """Splits generated text into reasoning and content, whole or streamed.

    One instance serves every request of a server: it keeps no per-request state. Streaming is
    computed from the text already streamed and the text now, so concatenated deltas always
    equal the fields of :meth:`extract_reasoning` on the final text.

    A subclass implements :meth:`split`, which must be monotone: as text grows, the reasoning
    and the content it reports only grow (what was shown is never taken back), which is why a
    possible partial tag at the end of an unfinished text is held back. A parser whose parts
    are two stretches of the text (``<think>`` tags) gives them as :class:`ReasoningSpans`
    (:meth:`split_spans`).

    Args:
        tokenizer: the engine's :class:`~pyxllm.engine.tokenizer.Tokenizer`.
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    @property
    def needs_special_tokens(self) -> bool:
        """True when decoding with ``skip_special_tokens`` would drop the parser's tags, so a
        reasoning request must keep special tokens in its text."""
        return False

    def end_token_ids(self) -> tuple[int, ...]:
        """The token ids that end the reasoning in generated text (a structured-output
        constraint applies after them); empty when the parser cannot say."""
        return ()

    def start_token_ids(self) -> tuple[int, ...]:
        """The token ids that open the reasoning in generated text (a model may write them
        itself, or the chat template may put them in the prompt); empty when the parser cannot
        say."""
        return ()

    def count_reasoning_tokens(self, token_ids: Sequence[int]) -> int:
        """The output tokens up to the end of the reasoning, its closing tag included; all of
        them while it never closed (OpenAI's ``reasoning_tokens`` of a reply whose reasoning
        this parser splits off)."""
        end = self.end_token_ids()
        start = find_token_ids(token_ids, end)
        return len(token_ids) if start < 0 else start + len(end)

    def is_reasoning_end(self, prompt_token_ids: Sequence[int]) -> bool:
        """True when the prompt itself closed the reasoning (e.g. a chat template rendered an
        empty think block for ``enable_thinking=False``): everything generated is content."""
        return False

    @abstractmethod
    def split(self, text: str, final: bool) -> tuple[str, str]:
        """``(reasoning, content)`` shown for ``text`` (either may be empty): each a prefix of
        the same part of every longer text.

        Args:
            text: the generated text so far.
            final: no more text follows; nothing may be held back.
        """

    @staticmethod
    def split_spans(text: str, spans: ReasoningSpans) -> tuple[str, str]:
        """The ``(reasoning, content)`` that ``spans`` mark in ``text``."""
        return (
            text[spans.reasoning_start : spans.reasoning_end],
            text[spans.content_start : spans.content_end],
        )

    def extract_reasoning(self, text: str) -> tuple[str | None, str | None]:
        """``(reasoning, content)`` of a whole generated text; an empty part is ``None``."""
        reasoning, content = self.split(text, final=True)
        return reasoning or None, content or None

    def extract_reasoning_streaming(
        self, previous_text: str, current_text: str, finished: bool = False
    ) -> ReasoningDelta:
        """What to stream now that the text grew from ``previous_text`` to ``current_text``.

        Args:
            previous_text: the text of the previous call (``""`` at first); its parts were
                streamed, except what was held back.
            current_text: the text now; starts with ``previous_text``.
            finished: ``current_text`` is final: release anything held back.
        """
        shown_reasoning, shown_content = self.split(previous_text, final=False)
        reasoning, content = self.split(current_text, final=finished)
        return ReasoningDelta(reasoning[len(shown_reasoning) :], content[len(shown_content) :])
