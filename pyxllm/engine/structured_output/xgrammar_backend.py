"""The xgrammar backend (``--structured-outputs-backend xgrammar``): JSON Schema, regex, choice,
EBNF (GBNF) and Lark grammars compiled to a pushdown automaton with a precomputed token-mask
cache (https://github.com/mlc-ai/xgrammar, Apache-2.0; vLLM's other default).

xgrammar declares triton, which a CPU build never imports: ``make`` installs it with
``--no-deps`` plus what it imports (``apache-tvm-ffi``).
"""

from __future__ import annotations

import json

import torch

from pyxllm.engine.structured_output.backend import GrammarError
from pyxllm.sampling_params import JSON_WHITESPACE_LIMIT, StructuredOutputsParams


class XGrammarMatcher:
    """One request's xgrammar matcher (see :class:`~.backend.GrammarMatcher`)."""

    def __init__(self, matcher) -> None:
        self.matcher = matcher

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def accept_token(self, token_id: int) -> bool:
        return bool(self.matcher.accept_token(token_id))

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()

    def validate_tokens(self, token_ids: list[int]) -> int:
        """Accepts the tokens while allowed (xgrammar has no dry run), then rolls them back."""
        accepted = 0
        for token_id in token_ids:
            if self.matcher.is_terminated() or not self.matcher.accept_token(token_id):
                break
            accepted += 1
        self.matcher.rollback(accepted)
        return accepted

    def rollback(self, num_tokens: int) -> None:
        self.matcher.rollback(num_tokens)

    def error(self) -> str:
        return ""  # xgrammar refuses a token without saying why


class XGrammarBackend:
    """xgrammar bound to a Hugging Face tokenizer (arguments as :class:`~.llguidance_backend.
    LLGuidanceBackend`'s).

    Raises:
        ImportError: xgrammar is not installed (``make install`` installs it).
    """

    name = "xgrammar"

    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids: list[int]) -> None:
        import xgrammar  # lazy: xgrammar is optional (make installs it)

        self._xgrammar = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(
            hf_tokenizer, vocab_size=vocab_size, stop_token_ids=list(eos_token_ids)
        )
        # threads of one compile; the manager's pool bounds how many compiles run at once
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=2)

    def compile(self, spec: StructuredOutputsParams):
        """The compiled grammar of ``spec``.

        Raises:
            GrammarError: it does not compile (xgrammar's message).
        """
        compiler = self.compiler
        whitespace = {"max_whitespace_cnt": JSON_WHITESPACE_LIMIT}
        if spec.disable_any_whitespace:
            whitespace = {"any_whitespace": False}
        try:
            if spec.kind == "json":
                schema = spec.json if isinstance(spec.json, str) else json.dumps(spec.json)
                return compiler.compile_json_schema(schema, **whitespace)
            if spec.kind == "json_object":
                return compiler.compile_json_schema('{"type": "object"}', **whitespace)
            if spec.kind == "regex":
                return compiler.compile_regex(spec.regex)
            if spec.kind == "choice":
                alternatives = " | ".join(json.dumps(c) for c in spec.choice)
                return compiler.compile_grammar(f"root ::= {alternatives}")
            if "::=" in spec.grammar:
                return compiler.compile_grammar(spec.grammar)
            return compiler.compile_lark(spec.grammar)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise GrammarError(str(exc).strip() or type(exc).__name__) from exc

    def new_matcher(self, compiled) -> XGrammarMatcher:
        return XGrammarMatcher(self._xgrammar.GrammarMatcher(compiled))

    def fill_bitmasks(self, matchers: list[XGrammarMatcher], bitmask: torch.Tensor) -> None:
        for row, matcher in enumerate(matchers):
            matcher.fill_bitmask(bitmask, row)
