"""The llguidance backend (the default): JSON Schema, regex, choice and Lark/GBNF grammars.

llguidance (https://github.com/guidance-ai/llguidance, MIT) compiles a constraint into an Earley
parser over a lexer and computes each step's token mask from the tokenizer's byte strings; vLLM
and SGLang use it the same way (``LLMatcher`` per request, ``fill_next_token_bitmask``). Its
parser limits bound what a pathological grammar can cost: past them it reports an error instead
of running on.
"""

from __future__ import annotations

import json

import torch

from pyxllm.engine.structured_output.backend import GrammarError
from pyxllm.engine.structured_output.json_schema import closed_objects
from pyxllm.sampling_params import JSON_WHITESPACE_LIMIT, StructuredOutputsParams

# At most JSON_WHITESPACE_LIMIT spaces, newlines or tabs between two JSON tokens (or none).
_JSON_OPTIONS = {"whitespace_pattern": rf"[\x20\x0A\x0D\x09]{{0,{JSON_WHITESPACE_LIMIT}}}"}
_COMPACT_JSON = {"whitespace_flexible": False}
# llguidance's Earley parser holds at most 2,000 items in a row, and a choice among N strings
# needs N + 1 once its first token is consumed: more fail then, not when compiled
MAX_CHOICES = 1999


class LLGuidanceMatcher:
    """One request's llguidance matcher (see :class:`~.backend.GrammarMatcher`)."""

    def __init__(self, matcher) -> None:
        self.matcher = matcher

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        from llguidance.torch import fill_next_token_bitmask  # lazy: see LLGuidanceBackend

        fill_next_token_bitmask(self.matcher, bitmask, row)

    def accept_token(self, token_id: int) -> bool:
        return bool(self.matcher.consume_token(token_id)) and not self.matcher.is_error()

    def is_terminated(self) -> bool:
        return self.matcher.is_stopped()

    def validate_tokens(self, token_ids: list[int]) -> int:
        return self.matcher.validate_tokens(token_ids)

    def rollback(self, num_tokens: int) -> None:
        self.matcher.rollback(num_tokens)

    def error(self) -> str:
        return self.matcher.get_error().split("\n", 1)[0] if self.matcher.is_error() else ""


class LLGuidanceBackend:
    """llguidance bound to a Hugging Face fast tokenizer.

    Args:
        hf_tokenizer: the model's ``transformers`` fast tokenizer.
        vocab_size: the model's vocabulary size (the logits' columns).
        eos_token_ids: the ids that end generation; the mask allows them where the constraint
            is complete.

    Raises:
        ImportError: llguidance is not installed.
    """

    name = "llguidance"

    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids: list[int]) -> None:
        # lazy: llguidance loads with the backend, on first use (a run with no constraint and
        # no API server never builds it)
        import llguidance
        import llguidance.hf

        self._llguidance = llguidance
        # ~0.5 s for a 49k vocabulary: the manager builds the backend on its thread pool
        self.tokenizer = llguidance.hf.from_tokenizer(
            hf_tokenizer, n_vocab=vocab_size, eos_token=list(eos_token_ids)
        )
        self._executor = llguidance.LLExecutor()

    def grammar_text(self, spec: StructuredOutputsParams) -> str:
        """llguidance's grammar for ``spec`` (not compiled yet).

        Raises:
            GrammarError: a JSON schema that is not a JSON object, or a grammar that is neither
                Lark nor GBNF.
        """
        from llguidance import grammar_from  # lazy, as in __init__

        matcher = self._llguidance.LLMatcher
        options = _COMPACT_JSON if spec.disable_any_whitespace else _JSON_OPTIONS
        try:
            if spec.kind == "json":
                schema = json.loads(spec.json) if isinstance(spec.json, str) else spec.json
                # objects closed as xgrammar's strict mode closes them (see closed_objects)
                return matcher.grammar_from_json_schema(closed_objects(schema), defaults=options)
            if spec.kind == "json_object":
                return matcher.grammar_from_json_schema({"type": "object"}, defaults=options)
            if spec.kind == "regex":
                return matcher.grammar_from_regex(spec.regex)
            if spec.kind == "choice":
                choices = list(dict.fromkeys(spec.choice))  # a repeat changes nothing
                if len(choices) > MAX_CHOICES:
                    raise GrammarError(
                        f"at most {MAX_CHOICES} different choices, got {len(choices)} "
                        "(llguidance's parser takes 2,000 items a row)"
                    )
                return grammar_from("choice", choices)
            return grammar_from("grammar", spec.grammar)
        except (TypeError, ValueError) as exc:
            raise GrammarError(str(exc)) from exc

    def compile(self, spec: StructuredOutputsParams):
        """A matcher at the start of ``spec``'s grammar, kept as the template of every request's
        (see :meth:`new_matcher`).

        Raises:
            GrammarError: the grammar does not compile (llguidance's message).
        """
        template = self._llguidance.LLMatcher(self.tokenizer, self.grammar_text(spec), log_level=0)
        if template.is_error():
            raise GrammarError(template.get_error())
        return template

    def new_matcher(self, compiled) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(compiled.deep_copy())

    def fill_bitmasks(self, matchers: list[LLGuidanceMatcher], bitmask: torch.Tensor) -> None:
        from llguidance.torch import fill_next_token_bitmask_par  # lazy, as in __init__

        if len(matchers) == 1:
            matchers[0].fill_bitmask(bitmask, 0)
            return
        pairs = [(m.matcher, row) for row, m in enumerate(matchers)]
        fill_next_token_bitmask_par(self._executor, pairs, bitmask)
