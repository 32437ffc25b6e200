"""Per-request sampling parameters, with vLLM's names and defaults."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class SamplingParams:
    """How one request samples and when it stops.

    Field names and meanings follow vLLM's ``SamplingParams`` (and so the OpenAI API):

    - ``temperature`` 0 means greedy (argmax); otherwise logits are divided by it.
    - ``top_p`` in (0, 1] keeps the smallest set of tokens whose probability sums to ``top_p``;
      ``top_k`` <= 0 (vLLM uses -1) disables top-k.
    - ``seed`` makes this request's random draws independent of the rest of the batch.
    - ``max_tokens`` is the number of new tokens (``None``: up to the model's context limit).
    - ``stop`` strings are matched on the detokenized text (across token boundaries) and are not
      returned; ``stop_token_ids`` stop on a token id (the token is not returned as text).
    - ``ignore_eos`` keeps generating past EOS tokens.

    Raises:
        ValueError: a value out of range; the message starts with the field name.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    max_tokens: int | None = 16
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.n != 1:
            raise ValueError(f"n: only n=1 is supported for now, got {self.n}")
        if self.temperature < 0:
            raise ValueError(f"temperature: must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p}")
        if self.top_k is None:
            self.top_k = -1
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens: must be >= 1, got {self.max_tokens}")

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax (temperature 0)."""
        return self.temperature < 1e-5
