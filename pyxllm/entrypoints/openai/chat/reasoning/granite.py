"""Granite 3.2's reasoning (``granite``): with thinking on, its chat template asks the model to
write ``Here is my thought process:``, the thinking, then ``Here is my response:`` and the
answer (``Here's`` in either phrase too, as vLLM's parser accepts).

A text that does not start with the first phrase (leading whitespace aside) is all content: the
model answered without thinking. One that starts with it is reasoning up to the second phrase,
content after it; without the second phrase (thinking cut off by ``max_tokens``) all of it is
reasoning. The phrases themselves are in neither part. While streaming, a text that may still
become the first phrase, and a trailing partial second phrase, are held back. The phrases are
plain text of several tokens, so the parser names no end token ids: a thinking budget, which
forces an end token, is refused with it.
"""

from __future__ import annotations

from collections.abc import Sequence

from pyxllm.entrypoints.openai.chat.reasoning.base import ReasoningParser, ReasoningSpans
from pyxllm.entrypoints.openai.chat.reasoning.think_tags import partial_tag_len

START_PHRASES = ("Here is my thought process:", "Here's my thought process:")
END_PHRASES = ("Here is my response:", "Here's my response:")


class GraniteReasoningParser(ReasoningParser):
    """Reasoning between Granite's two phrases, matched on text (see the module docstring)."""

    def split(self, text: str, final: bool) -> tuple[str, str]:
        """The text of :meth:`spans`."""
        return self.split_spans(text, self.spans(text, final))

    def spans(self, text: str, final: bool) -> ReasoningSpans:
        """Where the reasoning and the content lie in ``text`` (see the module docstring)."""
        n = len(text)
        body = text.lstrip()
        if not final and any(len(body) < len(p) and p.startswith(body) for p in START_PHRASES):
            return ReasoningSpans(0, 0, n, n)  # it may still become the first phrase
        phrase = next((p for p in START_PHRASES if body.startswith(p)), None)
        if phrase is None:
            return ReasoningSpans(0, 0, 0, n)
        start = n - len(body) + len(phrase)
        found = [(i, p) for p in END_PHRASES if (i := text.find(p, start)) >= 0]
        if found:
            end, closing = min(found)
            return ReasoningSpans(start, end, end + len(closing), n)
        held = 0 if final else max(partial_tag_len(text, p) for p in END_PHRASES)
        return ReasoningSpans(start, max(start, n - held), n, n)

    def count_reasoning_tokens(self, token_ids: Sequence[int]) -> int:
        """The output tokens up to the end of ``Here is my response:``: none when the model did
        not think, all of them when its thinking never closed; else the fewest tokens whose
        text holds the second phrase (a binary search over decoded prefixes)."""
        ids = list(token_ids)
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        spans = self.spans(text, final=True)
        if spans.reasoning_end == 0:
            return 0
        if spans.reasoning_end == len(text):
            return len(ids)
        lo, hi = 1, len(ids)
        while lo < hi:
            mid = (lo + hi) // 2
            prefix = self.tokenizer.decode(ids[:mid], skip_special_tokens=True)
            if len(prefix) >= spans.content_start:
                hi = mid
            else:
                lo = mid + 1
        return lo
