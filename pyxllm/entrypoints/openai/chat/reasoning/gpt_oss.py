"""gpt-oss's harmony reasoning (``openai_gptoss``, vLLM's name, and ``gpt_oss``): the
``analysis`` channel is the reasoning, the ``final`` channel the content.

The reply is read as harmony messages (:mod:`pyxllm.entrypoints.openai.chat.harmony`); their
headers and closing tokens are in neither field. Reasoning is the body of every ``analysis``
message (joined by a newline); content the body of every ``final`` message, of a
``commentary`` message with no recipient (a preamble) and of text outside any header. A
message sent to a recipient (a tool call, ``to=functions.NAME``) stays in the content as
written, header and all, for the ``openai`` tool parser to read.
"""

from __future__ import annotations

from collections.abc import Sequence

from pyxllm.entrypoints.openai.chat.harmony import (
    CHANNEL,
    END,
    MESSAGE,
    START,
    parse_messages,
    shown_text,
)
from pyxllm.entrypoints.openai.chat.reasoning.base import ReasoningParser, find_token_ids
from pyxllm.entrypoints.openai.chat.reasoning.think_tags import PROMPT_TAIL_TOKENS

ANALYSIS_HEADER = f"{CHANNEL}analysis{MESSAGE}"
# What ends the reasoning and opens the answer: a thinking budget forces it whole.
FINAL_HEADER = f"{END}{START}assistant{CHANNEL}final{MESSAGE}"


class GptOssReasoningParser(ReasoningParser):
    """Reasoning in harmony's ``analysis`` channel, matched on text (the special tokens must
    be kept in it)."""

    def __init__(self, tokenizer) -> None:
        super().__init__(tokenizer)
        ids = tokenizer.encode(CHANNEL, add_special_tokens=False)
        self._needs_special_tokens = CHANNEL not in tokenizer.decode(ids, skip_special_tokens=True)

    @property
    def needs_special_tokens(self) -> bool:
        """True when this tokenizer marks ``<|channel|>`` special (gpt-oss's does)."""
        return self._needs_special_tokens

    def end_token_ids(self) -> tuple[int, ...]:
        """``<|end|><|start|>assistant<|channel|>final<|message|>``: what closes the analysis
        and opens the final answer."""
        return tuple(self.tokenizer.encode(FINAL_HEADER, add_special_tokens=False))

    def start_token_ids(self) -> tuple[int, ...]:
        """``<|channel|>analysis<|message|>``."""
        return tuple(self.tokenizer.encode(ANALYSIS_HEADER, add_special_tokens=False))

    def count_reasoning_tokens(self, token_ids: Sequence[int]) -> int:
        """The tokens of the analysis message the reply opens with, through its ``<|end|>``
        (all of them while it never closed); else those through a forced end of thinking
        (:meth:`end_token_ids`, a thinking budget's); else none (a reply that answered or
        called at once)."""
        if list(token_ids[: len(start := self.start_token_ids())]) == list(start):
            end = tuple(self.tokenizer.encode(END, add_special_tokens=False))
            found = find_token_ids(token_ids, end)
            return len(token_ids) if found < 0 else found + len(end)
        end = self.end_token_ids()
        found = find_token_ids(token_ids, end)
        return 0 if found < 0 else found + len(end)

    def is_reasoning_end(self, prompt_token_ids: Sequence[int]) -> bool:
        """True when the prompt ends inside a final message's header (a template that skips
        the analysis): everything generated is content."""
        tail = self.tokenizer.decode(
            list(prompt_token_ids[-PROMPT_TAIL_TOKENS:]), skip_special_tokens=False
        )
        return tail.rstrip().endswith(f"{CHANNEL}final{MESSAGE}")

    def split(self, text: str, final: bool) -> tuple[str, str]:
        """The analysis bodies, and the rest's bodies (a call's message as written)."""
        reasoning: list[str] = []
        content: list[str] = []
        for message in parse_messages(text, final):
            if message.channel == "analysis" and message.recipient is None:
                reasoning.append(text[message.body_start : message.body_end])
            elif message.recipient is not None:
                content.append(shown_text(text, message))
            else:
                content.append(text[message.body_start : message.body_end])
        return "\n".join(reasoning), "".join(content)
