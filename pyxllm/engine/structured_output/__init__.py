"""Structured outputs: constraints compiled by a grammar library, matched per request, applied
as a bitmask on the logits of the constrained rows (see :mod:`.manager`)."""

from pyxllm.engine.structured_output.backend import GrammarError, GrammarMatcher, bitmask_width
from pyxllm.engine.structured_output.manager import GrammarHandle, StructuredOutputManager

__all__ = [
    "GrammarError",
    "GrammarHandle",
    "GrammarMatcher",
    "StructuredOutputManager",
    "bitmask_width",
]
