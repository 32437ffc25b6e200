"""What the engine returns for a request, shaped like vLLM's ``RequestOutput``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(slots=True)
class Logprob:
    """One token's log-probability (natural log, <= 0; ``-inf`` for a token the sampling
    settings ruled out), its 1-based rank in its distribution (1: the most likely) and its text
    decoded alone (``None`` until decoded)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per position: token id -> Logprob, the chosen (or prompt) token first, then the top ones.
SampleLogprobs = list[dict[int, Logprob]]
# Per prompt position: the same, ``None`` for the first token (it has no context).
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass(slots=True)
class CompletionOutput:
    """One generated sequence of a request.

    ``text`` and ``token_ids`` are cumulative (everything generated so far); while streaming,
    ``text`` only ever grows, so a delta is ``text[len(previous_text):]``. ``finish_reason`` is
    ``None`` until the sequence finishes, then ``"stop"`` (EOS, stop string or stop token),
    ``"length"`` (max_tokens or the context limit) or ``"abort"``. ``stop_reason`` is the
    matched stop string or stop token id, ``None`` for EOS or when not stopped. ``logprobs``
    (when the request asked for them) has one entry per token of ``token_ids``.
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: SampleLogprobs | None = None


@dataclass(slots=True)
class RequestOutput:
    """The state of one request after an engine step: its prompt and its outputs.

    ``outputs`` holds ``n`` completions, ``outputs[i].index == i``; ``finished`` is true once
    all of them finished. ``prompt_logprobs`` (when asked for) has one entry per prompt token.

    ``prompt_logprobs_tensor`` (with ``SamplingParams(prompt_logprobs=-1)``, else ``None``): the
    raw model's log-softmax over the whole vocabulary at every prompt position but the last,
    ``float32 [num_prompt_tokens - 1, vocab_size]`` on the CPU, natural log; row ``j`` is the
    distribution of token ``j + 1`` given tokens ``0..j``, so ``row[j, prompt_token_ids[j + 1]]``
    is vLLM's ``prompt_logprobs[j + 1][prompt_token_ids[j + 1]].logprob`` (vLLM's
    ``prompt_logprobs=-1`` gives the same values as ``vocab_size`` dicts per token).

    ``num_cached_tokens`` (vLLM's field): the prompt tokens found in the prefix cache when the
    request was first scheduled (whole blocks, never the last prompt token; with ``n > 1``,
    the first sample's); ``None`` until it is scheduled.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    prompt_logprobs: PromptLogprobs | None = None
    prompt_logprobs_tensor: torch.Tensor | None = None
    num_cached_tokens: int | None = None


@dataclass(slots=True)
class BeamSearchSequence:
    """One sequence of a beam search (vLLM's ``BeamSearchSequence``).

    Attributes:
        tokens: the prompt's token ids and the generated ones (a finishing EOS included).
        logprobs: per generated token, the top logprobs at its position (token id ->
            :class:`~pyxllm.outputs.Logprob`, natural log).
        cum_logprob: the generated tokens' summed logprob.
        score: ``cum_logprob / len(generated) ** length_penalty``, the rank of a finished
            sequence (transformers' ``sequences_scores``; a pyxllm addition).
        text: the decoded ``tokens`` (filled when returned).
        finish_reason: ``"stop"`` (an EOS token) or ``"length"`` (``max_tokens``).
        stop_reason: the EOS token id that finished it, else ``None``.
    """

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    score: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass(slots=True)
class BeamSearchOutput:
    """A prompt's beam search result (vLLM's ``BeamSearchOutput``): ``beam_width`` sequences,
    best score first."""

    sequences: list[BeamSearchSequence]


@dataclass(slots=True)
class PoolingOutput:
    """A pooling request's result (vLLM's ``PoolingOutput``): ``data``, the pooled vector,
    ``float32`` on the CPU: an embedding model's ``[dimensions]`` (the model's ``hidden_size``
    unless the request asked for fewer dimensions), L2-normalized where the model (or the
    request) normalizes; a classifier's ``[num_labels]`` activated outputs (a cross-encoder's
    one score)."""

    data: torch.Tensor

    @property
    def embedding(self) -> list[float]:
        """``data`` as a list of floats (vLLM's ``EmbeddingOutput.embedding``)."""
        return self.data.tolist()


@dataclass(slots=True)
class PoolingRequestOutput:
    """The result of one embedding request (vLLM's ``PoolingRequestOutput``; the embed task):
    it comes once, finished, after the step that computed its prompt."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: PoolingOutput
    finished: bool = True


@dataclass(slots=True)
class ScoringOutput:
    """A text pair's score (vLLM's ``ScoringOutput``): with an embedding model, the cosine
    similarity of the two texts' embeddings, in [-1, 1]; with a cross-encoder, its output for
    the pair (sigmoid of its logit, in [0, 1], unless the model names another activation)."""

    score: float


@dataclass(slots=True)
class ScoringRequestOutput:
    """The result of scoring one text pair (vLLM's ``ScoringRequestOutput``): ``prompt_token_ids``
    are the two texts' token ids, the first text's then the second's."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: ScoringOutput
    finished: bool = True


@dataclass(slots=True)
class ClassificationOutput:
    """A classifier's result for one prompt (vLLM's ``ClassificationOutput``): ``probs``, one
    value per class (softmax over the logits for a model of several labels, see
    :func:`pyxllm.layers.pooler.classifier_activation`)."""

    probs: list[float]

    @property
    def num_classes(self) -> int:
        """The number of classes (the model's ``num_labels``)."""
        return len(self.probs)


@dataclass(slots=True)
class ClassificationRequestOutput:
    """The result of classifying one prompt (vLLM's ``ClassificationRequestOutput``)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: ClassificationOutput
    finished: bool = True
