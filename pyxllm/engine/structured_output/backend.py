"""What a grammar library gives the engine: compiled grammars and per-request matchers.

pyxllm writes no grammar code: a backend wraps a library (llguidance by default, xgrammar on
request). The vocabulary is the model's ``vocab_size`` rows (the logits' columns); ids the
tokenizer does not have are never allowed.

Bitmasks are vLLM's and both libraries' layout: ``int32 [rows, ceil(vocab_size / 32)]``, bit
``t % 32`` of word ``t // 32`` set when token ``t`` is allowed.
"""

from __future__ import annotations

from typing import Protocol

import torch

from pyxllm.sampling_params import StructuredOutputsParams


class GrammarError(ValueError):
    """A constraint the backend cannot compile (a bad schema, regex or grammar, or a feature the
    library does not support); the message is the library's."""


def bitmask_width(vocab_size: int) -> int:
    """Words of a bitmask row: ``ceil(vocab_size / 32)``."""
    return (vocab_size + 31) // 32


class GrammarMatcher(Protocol):
    """The state of one request's constraint: what may come next, advanced token by token."""

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (int32, CPU, contiguous)."""
        ...

    def accept_token(self, token_id: int) -> bool:
        """Advance past ``token_id``; ``False`` when the constraint does not allow it (the
        matcher is then in an error state)."""
        ...

    def is_terminated(self) -> bool:
        """Whether the constraint is complete and allows nothing but EOS."""
        ...

    def validate_tokens(self, token_ids: list[int]) -> int:
        """How many of ``token_ids``, in order from the start, the constraint allows next; the
        matcher's state does not change (speculative drafts are cut there)."""
        ...

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens."""
        ...

    def error(self) -> str:
        """Why the matcher is in an error state, in the library's words (first line; empty
        when it is not, or when the library does not say)."""
        ...


class StructuredOutputBackend(Protocol):
    """A grammar library bound to one model's tokenizer and vocabulary.

    ``compile`` may take long (it runs on the manager's thread pool, never on the engine loop);
    ``new_matcher`` is cheap (a copy of the compiled grammar's start state).
    """

    name: str

    def compile(self, spec: StructuredOutputsParams) -> object:
        """The compiled grammar of ``spec`` (opaque, shared by every request with the spec).

        Raises:
            GrammarError: the spec does not compile.
        """
        ...

    def new_matcher(self, compiled: object) -> GrammarMatcher:
        """A matcher at the start of ``compiled``."""
        ...

    def fill_bitmasks(self, matchers: list[GrammarMatcher], bitmask: torch.Tensor) -> None:
        """Fill row ``i`` of ``bitmask`` for ``matchers[i]`` (possibly in parallel)."""
        ...
