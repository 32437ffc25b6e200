"""``--speculative-config``: vLLM's JSON flag for speculative decoding, parsed and checked.

``{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
"prompt_lookup_max": 5}`` proposes the tokens that followed the last earlier occurrence of the
sequence's longest suffix (prompt lookup); ``{"method": "draft_model", "model": PATH,
"num_speculative_tokens": 4}`` proposes a small model's greedy continuation. Either way the
target model verifies the ``k`` proposed tokens in one forward pass and the output is exactly
what decoding without speculation gives (see :mod:`pyxllm.executor.spec_decode`).
``disable_by_batch_size`` turns speculation off for steps with more running sequences than it
(vLLM's knob; a batch that large is bound by arithmetic, not by reading weights).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

SPECULATIVE_METHODS = ("ngram", "draft_model")
# Steps with more running sequences than this do not speculate unless the config says
# otherwise: above a few sequences a decode step's cost grows with its tokens, so verifying k
# more tokens per sequence no longer comes free (measured: benchmarks/speculative.py,
# docs/speculative.md).
DEFAULT_DISABLE_BY_BATCH_SIZE = 4


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """Speculative decoding settings (``--speculative-config``, vLLM's keys).

    Attributes:
        method: ``ngram`` (prompt lookup) or ``draft_model``.
        num_speculative_tokens: ``k``, tokens proposed per step and sequence (>= 1).
        prompt_lookup_min / prompt_lookup_max: the n-gram lengths matched (n-gram only), in
            tokens, ``1 <= min <= max``; 3 and 5 by default (2-token matches are wrong too
            often in free-form text, where each rejected draft costs a verification step).
        model: the draft model (a path or model id; draft_model only); it must share the
            target's vocabulary.
        disable_by_batch_size: no speculation in a step with more running sequences than this.
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 3
    prompt_lookup_max: int = 5
    model: str | None = None
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE

    @classmethod
    def parse(cls, value: str | dict[str, Any]) -> SpeculativeConfig:
        """The config of a JSON object (text, as the flag gives it, or a dict).

        Raises:
            ValueError: not a JSON object, an unknown key or method, or a value out of range;
                one line naming ``--speculative-config`` and the key.
        """
        flag = "--speculative-config"
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{flag}: not valid JSON ({exc})") from None
        if not isinstance(value, dict):
            raise ValueError(f"{flag}: must be a JSON object, got {value!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(
                f"{flag}: unknown key {unknown[0]!r}; known: {', '.join(sorted(known))}"
            )
        method = value.get("method")
        if method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"{flag}: method must be one of {', '.join(SPECULATIVE_METHODS)}, got {method!r}"
            )
        if "num_speculative_tokens" not in value:
            raise ValueError(f"{flag}: num_speculative_tokens is required")
        for key in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            if key in value and (type(value[key]) is not int or value[key] < 1):
                raise ValueError(f"{flag}: {key} must be an integer >= 1, got {value[key]!r}")
        config = cls(**value)
        if config.prompt_lookup_min > config.prompt_lookup_max:
            raise ValueError(
                f"{flag}: prompt_lookup_min ({config.prompt_lookup_min}) must not exceed "
                f"prompt_lookup_max ({config.prompt_lookup_max})"
            )
        if type(config.disable_by_batch_size) is not int or config.disable_by_batch_size < 1:
            raise ValueError(
                f"{flag}: disable_by_batch_size must be an integer >= 1, got "
                f"{config.disable_by_batch_size!r}"
            )
        if (config.method == "draft_model") != (config.model is not None):
            raise ValueError(
                f"{flag}: model (the draft's path) is required by method draft_model and only by it"
            )
        return config

    def to_json(self) -> str:
        """The config as the flag's JSON text."""
        return json.dumps({f.name: getattr(self, f.name) for f in fields(self)})
