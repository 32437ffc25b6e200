"""``<think>...</think>`` reasoning, as Qwen3 and DeepSeek-R1 write it (``qwen3``,
``deepseek_r1``).

The model may or may not write the opening ``<think>``: a chat template can put it in the
prompt. So the text before ``</think>`` is reasoning (a leading ``<think>`` dropped) and the
text after it is content; without ``</think>`` (thinking cut off by ``max_tokens``) all of it
is reasoning. When the prompt already ends with a closed think block (Qwen3's template with
``enable_thinking=False`` renders ``<think>\\n\\n</think>\\n\\n``), the server does not split
at all: everything is content. Text is kept verbatim: reasoning + ``</think>`` + content is the
generated text (less a leading ``<think>``).
"""

from __future__ import annotations

from collections.abc import Sequence

from pyxllm.entrypoints.openai.chat.reasoning.base import ReasoningParser, ReasoningSpans

# Prompt tokens decoded to see whether the prompt closed the think block.
PROMPT_TAIL_TOKENS = 16


def partial_tag_len(text: str, tag: str) -> int:
    """Length of the longest proper prefix of ``tag`` that ``text`` ends with (0 if none)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ThinkTagReasoningParser(ReasoningParser):
    """Reasoning between ``<think>`` and ``</think>``, matched on text (the tags may be one
    token each or several, special or not)."""

    start_tag = "<think>"
    end_tag = "</think>"

    def __init__(self, tokenizer) -> None:
        super().__init__(tokenizer)
        ids = tokenizer.encode(self.end_tag, add_special_tokens=False)
        decoded = tokenizer.decode(ids, skip_special_tokens=True)
        self._needs_special_tokens = self.end_tag not in decoded

    @property
    def needs_special_tokens(self) -> bool:
        """True when this tokenizer marks ``</think>`` special, so that decoding drops it."""
        return self._needs_special_tokens

    def end_token_ids(self) -> tuple[int, ...]:
        """``</think>`` as the tokenizer writes it alone (one id for Qwen3's added token)."""
        return tuple(self.tokenizer.encode(self.end_tag, add_special_tokens=False))

    def start_token_ids(self) -> tuple[int, ...]:
        """``<think>`` as the tokenizer writes it alone."""
        return tuple(self.tokenizer.encode(self.start_tag, add_special_tokens=False))

    def is_reasoning_end(self, prompt_token_ids: Sequence[int]) -> bool:
        """True when the prompt ends with ``</think>`` (and whitespace)."""
        tail = self.tokenizer.decode(
            list(prompt_token_ids[-PROMPT_TAIL_TOKENS:]), skip_special_tokens=False
        )
        return tail.rstrip().endswith(self.end_tag)

    def split(self, text: str, final: bool) -> tuple[str, str]:
        """The text of :meth:`spans`."""
        return self.split_spans(text, self.spans(text, final))

    def spans(self, text: str, final: bool) -> ReasoningSpans:
        """Reasoning up to the first ``</think>``, content after it; unless ``final``, a text
        that may still become ``<think>`` and a trailing partial ``</think>`` are held back."""
        n = len(text)
        if not final and n < len(self.start_tag) and self.start_tag.startswith(text):
            return ReasoningSpans(0, 0, n, n)
        start = len(self.start_tag) if text.startswith(self.start_tag) else 0
        end = text.find(self.end_tag, start)
        if end >= 0:
            return ReasoningSpans(start, end, end + len(self.end_tag), n)
        held = 0 if final else partial_tag_len(text, self.end_tag)
        return ReasoningSpans(start, max(start, n - held), n, n)
