"""Per-request sampling parameters, with vLLM's names, defaults and checks."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

# Most top logprobs a request may ask for, per token (vLLM's default ``max_logprobs``; OpenAI's
# ``top_logprobs`` limit).
MAX_LOGPROBS = 20
# ``prompt_logprobs`` asking for the whole vocabulary at every prompt position (vLLM's -1), as
# one tensor (``RequestOutput.prompt_logprobs_tensor``) instead of per-token dicts.
FULL_VOCAB_LOGPROBS = -1
# Bounds of a ``logit_bias`` value, as OpenAI documents them.
LOGIT_BIAS_LIMIT = 100.0
# Bounds that keep float32 sampling arithmetic finite: logits (|x| < ~1e3) divided by a
# temperature >= 1e-5 (below, a request is greedy) or scaled by a penalty in this range stay far
# below float32's largest value (3.4e38); a penalty of 1e-45 (a float32 denormal) made +inf, then
# NaN logprobs. vLLM only asks for > 0.
REPETITION_PENALTY_RANGE = (1e-6, 1e6)
MAX_TEMPERATURE = 1e6
# The fields a model's generation_config.json may default, with the values they take when
# neither the request nor the model sets them (vLLM's, and so OpenAI's, defaults).
MODEL_DEFAULTABLE = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": -1,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
}


@dataclass(frozen=True, slots=True)
class StructuredOutputsParams:
    """A constraint on a request's output (vLLM's ``StructuredOutputsParams``): exactly one of

    - ``json``: a JSON Schema (a dict, or its JSON text) the output must validate against;
    - ``regex``: a regular expression the whole output must match (Rust ``regex`` syntax);
    - ``choice``: the output is one of these strings;
    - ``grammar``: a context-free grammar in Lark syntax (llguidance's) or GBNF;
    - ``json_object``: ``True`` for any JSON object.

    ``field`` names the request field the constraint came from, for error messages (the server
    sets ``response_format.json_schema.schema`` and the like; default
    ``structured_outputs.<kind>``).
    JSON is generated with at most :data:`JSON_WHITESPACE_LIMIT` whitespace characters between
    two JSON tokens, so a model cannot spend its tokens on whitespace; with
    ``disable_any_whitespace`` (vLLM's option) with none at all (compact JSON).

    Raises:
        ValueError: none or several kinds given, or an empty choice list (the message names the
            field).
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    field: str | None = None

    def __post_init__(self) -> None:
        kinds = [k for k in _STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        if len(kinds) != 1:
            given = ", ".join(kinds) or "none"
            raise ValueError(
                f"structured_outputs: give exactly one of {', '.join(_STRUCTURED_KINDS)} "
                f"(got {given})"
            )
        if self.choice is not None:
            if not self.choice or not all(isinstance(c, str) for c in self.choice):
                raise ValueError(f"{self.source}: must be a non-empty list of strings")
            object.__setattr__(self, "choice", tuple(self.choice))

    @property
    def kind(self) -> str:
        """Which constraint this is: ``json``, ``regex``, ``choice``, ``grammar`` or
        ``json_object``."""
        return next(k for k in _STRUCTURED_KINDS if getattr(self, k) not in (None, False))

    @property
    def source(self) -> str:
        """The request field to name in errors about this constraint."""
        return self.field or f"structured_outputs.{self.kind}"


_STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")
# Whitespace characters allowed between two JSON tokens of a constrained output.
JSON_WHITESPACE_LIMIT = 8


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one request samples and when it stops; immutable once built (a changed copy is
    :meth:`replace`'s).

    Field names and meanings follow vLLM's ``SamplingParams`` (and so the OpenAI API):

    - ``n`` independent samples of the same prompt (with a ``seed``, sample ``i`` uses
      ``seed + i``, so sample 0 is what ``n=1`` with that seed gives).
    - ``temperature`` 0 (or below 1e-5) means greedy (argmax); otherwise logits are divided by
      it (at most :data:`MAX_TEMPERATURE`).
    - ``top_p`` in (0, 1] keeps the smallest set of tokens whose probability sums to ``top_p``;
      ``top_k`` <= 0 (vLLM uses -1) disables top-k; ``min_p`` in [0, 1] drops tokens less
      likely than ``min_p`` times the most likely one.
    - ``repetition_penalty`` in :data:`REPETITION_PENALTY_RANGE` (1 = off) divides positive
      logits and multiplies negative ones of every token seen in the prompt or the output;
      ``presence_penalty`` and ``frequency_penalty`` in [-2, 2] subtract a constant, and a
      constant per occurrence, from the logits of tokens already generated (the prompt does
      not count).
    - ``logit_bias`` maps token id -> a value in [-100, 100] added to its logit (string keys,
      as in OpenAI's JSON, are converted).
    - ``seed`` (in [-2**63, 2**64), torch's range; taken modulo 2**64) makes this request's
      random draws independent of the rest of the batch.
    - ``max_tokens`` is the number of new tokens (``None``: up to the model's context limit);
      ``min_tokens`` new tokens come before any EOS or ``stop_token_ids`` token may be sampled.
    - ``stop`` strings are matched on the detokenized text (across token boundaries) and are not
      returned unless ``include_stop_str_in_output``; ``stop_token_ids`` stop on a token id.
    - ``ignore_eos`` keeps generating past EOS tokens.
    - Left unset (or ``None``), ``temperature``, ``top_p``, ``top_k``, ``min_p`` and
      ``repetition_penalty`` take the model's ``generation_config.json`` value when the request
      is processed (:meth:`with_model_defaults`, vLLM's ``generation_config="auto"``), else
      :data:`MODEL_DEFAULTABLE`'s; until then they read as the latter and
      ``unset_fields`` names them. vLLM applies the model's values only when ``LLM.generate``
      gets no ``SamplingParams`` at all; here ``SamplingParams()`` and an HTTP request that
      omits the fields behave the same.
    - ``structured_outputs``: a :class:`StructuredOutputsParams` constraint on the output
      (EOS is allowed only where the constraint is satisfied; ``max_tokens`` may still cut it
      short, with ``finish_reason`` ``length``).
    - ``logprobs``: return the log-probability of each sampled token and of the ``logprobs``
      most likely tokens (0: the sampled one only), up to :data:`MAX_LOGPROBS`;
      ``prompt_logprobs``: the same for each prompt token (the first gets ``None``);
      :data:`FULL_VOCAB_LOGPROBS` (-1, vLLM's "all ``vocab_size`` logprobs") returns the raw
      model's log-softmax at every prompt position as one tensor,
      ``RequestOutput.prompt_logprobs_tensor``, rather than ``vocab_size`` dicts per token.
    - ``thinking_token_budget`` (vLLM's field): at most this many reasoning tokens (>= 0; 0
      closes the thinking at once; ``None``: no limit); once the output holds that many
      without having ended its reasoning, the engine forces ``think_end_token_ids`` (one
      token a step) and the content follows (see :mod:`pyxllm.engine.thinking_budget`).
      ``think_start_token_ids`` / ``think_end_token_ids`` (vLLM's ``ReasoningConfig``
      names) are the tags that open and close the reasoning; the OpenAI server fills them
      from ``--reasoning-parser``, ``LLM`` from its ``reasoning_parser``; a budget needs the
      end tag's ids by the time the engine takes the request.
    - ``extra_args`` (vLLM's field): arguments for parts of the engine beside sampling. Its
      key ``kv_transfer_params`` (vLLM's name, the request field of the same name) tells a
      prefill instance with ``--kv-transfer-push`` where the request's decode runs:
      ``{"remote_host": ..., "remote_port": ...}``, the ``--kv-transfer-listen`` address
      of that decode instance, which then alone gets the request's KV blocks (see
      :mod:`pyxllm.engine.kv_connector`); other keys are ignored.

    Raises:
        ValueError: a value out of range; the message starts with the field name.
    """

    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    structured_outputs: StructuredOutputsParams | None = None
    thinking_token_budget: int | None = None
    think_start_token_ids: tuple[int, ...] = ()
    think_end_token_ids: tuple[int, ...] = ()
    extra_args: dict[str, Any] | None = None
    unset_fields: frozenset[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # the one place fields are written after __init__: normalising what was given
        normalise = object.__setattr__
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        normalise(self, "stop", [s for s in (stop or []) if s])
        normalise(self, "stop_token_ids", list(self.stop_token_ids or []))
        normalise(self, "think_start_token_ids", tuple(self.think_start_token_ids or ()))
        normalise(self, "think_end_token_ids", tuple(self.think_end_token_ids or ()))
        unset = [name for name in MODEL_DEFAULTABLE if getattr(self, name) is None]
        for name in unset:
            normalise(self, name, MODEL_DEFAULTABLE[name])
        normalise(self, "unset_fields", frozenset(unset))
        normalise(self, "logit_bias", _int_keys(self.logit_bias) or None)
        self._check()

    def replace(self, **changes) -> SamplingParams:
        """A copy with ``changes`` (field name -> value), checked as a new one is; the fields
        still unset stay unset (``dataclasses.replace`` alone would read their stand-in values
        as given).

        Raises:
            ValueError: a value out of range (the message names the field).
        """
        copy = replace(self, **changes)
        object.__setattr__(copy, "unset_fields", self.unset_fields - changes.keys())
        return copy

    def with_model_defaults(self, defaults: Mapping[str, float | int]) -> SamplingParams:
        """A copy whose unset fields take ``defaults`` (a model's generation_config values, by
        field name; other keys are ignored); ``self`` when none applies.

        Raises:
            ValueError: a model default out of range (the message names the field).
        """
        taken = {
            name: defaults[name] for name in self.unset_fields if defaults.get(name) is not None
        }
        return self.replace(**taken) if taken else self

    def _check(self) -> None:
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            if not math.isfinite(value):
                raise ValueError(f"{name}: must be a finite number, got {value}")
        if self.n < 1:
            raise ValueError(f"n: must be >= 1, got {self.n}")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            raise ValueError(f"seed: must be in [-2**63, 2**64), got {self.seed}")
        if not 0 <= self.temperature <= MAX_TEMPERATURE:
            raise ValueError(
                f"temperature: must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature}"
            )
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k: must be -1 or 0 (off) or >= 1, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p: must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name}: must be in [-2, 2], got {getattr(self, name)}")
        low, high = REPETITION_PENALTY_RANGE
        if not low <= self.repetition_penalty <= high:
            raise ValueError(
                f"repetition_penalty: must be in [{low:g}, {high:g}], got {self.repetition_penalty}"
            )
        for token_id, bias in (self.logit_bias or {}).items():
            if not -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT:
                raise ValueError(
                    f"logit_bias: the bias of token {token_id} must be in [-100, 100], got {bias}"
                )
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens: must be >= 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens: must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens: {self.min_tokens} is more than max_tokens ({self.max_tokens})"
            )
        _check_kv_transfer_params((self.extra_args or {}).get("kv_transfer_params"))
        if self.thinking_token_budget is not None:
            if self.thinking_token_budget < 0:
                raise ValueError(
                    f"thinking_token_budget: must be >= 0, got {self.thinking_token_budget}"
                )
        for name in ("logprobs", "prompt_logprobs"):
            value, prompt = getattr(self, name), name == "prompt_logprobs"
            if (
                value is None
                or 0 <= value <= MAX_LOGPROBS
                or (prompt and value == FULL_VOCAB_LOGPROBS)
            ):
                continue
            full = " or -1 (the whole vocabulary)" if prompt else ""
            raise ValueError(f"{name}: must be in [0, {MAX_LOGPROBS}]{full}, got {value}")

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax (temperature 0)."""
        return self.temperature < 1e-5

    @property
    def uses_penalties(self) -> bool:
        """True when a repetition, presence or frequency penalty changes the logits."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )


@dataclass(frozen=True, slots=True)
class BeamSearchParams:
    """How one beam search runs (vLLM's ``BeamSearchParams``; see
    :mod:`pyxllm.engine.beam_search` for the algorithm, which is transformers').

    - ``beam_width`` beams are kept at each step, and as many sequences come back, best first
      (at most :data:`MAX_LOGPROBS` // 2: each beam asks for ``2 * beam_width`` candidates).
    - ``max_tokens`` new tokens at most (>= 1).
    - ``ignore_eos``: an EOS token does not finish a beam.
    - ``temperature``: 0 only. Beams are ranked by the model's log-probabilities; vLLM takes a
      temperature here that its (raw) logprobs ignore, so a value above 0 is refused rather
      than silently ignored.
    - ``length_penalty``: a finished sequence's score is its summed logprob divided by its
      length (generated tokens, EOS included) to this power; above 0 favours longer ones.
    - ``include_stop_str_in_output``: keep a finishing EOS token in the sequence's tokens.

    Raises:
        ValueError: a value out of range; the message starts with the field name.
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        most = MAX_LOGPROBS // 2
        if not 1 <= self.beam_width <= most:
            raise ValueError(f"beam_width: must be in [1, {most}], got {self.beam_width}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens: must be >= 1, got {self.max_tokens}")
        if self.temperature != 0:
            raise ValueError(
                f"temperature: beam search is deterministic (it ranks beams by the model's "
                f"log-probabilities); must be 0, got {self.temperature}"
            )
        if not math.isfinite(self.length_penalty):
            raise ValueError(f"length_penalty: must be a finite number, got {self.length_penalty}")


_FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)


def _int_keys(bias: dict | None) -> dict[int, float]:
    """``logit_bias`` with int keys ("42" -> 42) and float values.

    Raises:
        ValueError: a key that is not an integer token id, or a value that is not a number.
    """
    out: dict[int, float] = {}
    for key, value in (bias or {}).items():
        try:
            token_id = int(key)
        except (TypeError, ValueError):
            raise ValueError(f"logit_bias: keys must be token ids, got {key!r}") from None
        try:
            out[token_id] = float(value)
        except (TypeError, ValueError):
            raise ValueError(
                f"logit_bias: the bias of token {key} must be a number, got {value!r}"
            ) from None
    return out


def _check_kv_transfer_params(params: Any) -> None:
    """Raise a ValueError naming ``kv_transfer_params`` unless ``params`` is ``None`` or an
    object whose ``remote_host`` (if given) is a non-empty string and ``remote_port`` (if
    given) a port number, the two given together."""
    if params is None:
        return
    if not isinstance(params, dict):
        raise ValueError(f"kv_transfer_params: must be an object, got {type(params).__name__}")
    host, port = params.get("remote_host"), params.get("remote_port")
    if (host is None) != (port is None):
        raise ValueError("kv_transfer_params: give remote_host and remote_port together")
    if host is not None and (not isinstance(host, str) or not host):
        raise ValueError(f"kv_transfer_params: remote_host must be a host name, got {host!r}")
    if port is not None and (
        not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536
    ):
        raise ValueError(f"kv_transfer_params: remote_port must be a port number, got {port!r}")
