"""Beam search over HTTP: vLLM's ``use_beam_search`` extra field on ``/v1/completions`` and
``/v1/chat/completions``.

As in vLLM, ``n`` is the beam width and every beam comes back as a choice, best first;
``length_penalty`` (vLLM's field, default 1) divides a finished beam's summed logprob by its
length to that power; ``ignore_eos``, ``include_stop_str_in_output``, ``skip_special_tokens``
and ``max_tokens`` / ``max_completion_tokens`` keep their meaning. A streamed beam search sends
each choice whole, in one chunk, once the search ends (vLLM does the same: the search has no
partial result). The search itself is :mod:`pyxllm.engine.beam_search`, the same as
``LLM.beam_search``.

Fields whose effect beam search would drop are refused with a 400 naming them rather than
ignored: sampling (``temperature`` above 0, ``top_p``, ``top_k``, ``min_p``), penalties and
``logit_bias`` (the beams are ranked by the model's own logprobs), ``stop``, ``stop_token_ids``
and ``min_tokens`` (only EOS and ``max_tokens`` end a beam), ``logprobs``, structured outputs,
``tools`` and ``thinking_token_budget``.
"""

from __future__ import annotations

from collections.abc import Iterable

from pyxllm.engine.beam_search import BeamSearch
from pyxllm.engine.input_processor import EngineRequest
from pyxllm.entrypoints.openai.errors import OpenAIError, param_from_message
from pyxllm.entrypoints.openai.protocol import SamplingFields
from pyxllm.sampling_params import BeamSearchParams

# Request fields beam search cannot honour, with the values that mean leaving them out.
_CONFLICTS = {
    "temperature": (None, 0),
    "top_p": (None, 1),
    "top_k": (None, 0, -1),
    "min_p": (None, 0),
    "repetition_penalty": (None, 1),
    "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0),
    "logit_bias": (None, {}),
    "stop": (None, [], ""),
    "stop_token_ids": (None, []),
    "min_tokens": (None, 0),
    "tools": (None, []),
    "thinking_token_budget": (None,),
}


def check_beam_search_fields(request: SamplingFields, fields: dict) -> None:
    """400 naming the first field that cannot be combined with ``use_beam_search`` (none when
    the request does not ask for it), or ``length_penalty`` set without it. ``fields`` are the
    request's sampling fields (``logprobs``, ``structured_outputs``).

    Raises:
        OpenAIError: 400 naming the field.
    """
    if not request.use_beam_search:
        if request.length_penalty not in (None, 1):
            raise OpenAIError(
                "length_penalty: only used with use_beam_search", 400, "length_penalty"
            )
        return
    for name, neutral in _CONFLICTS.items():
        if getattr(request, name, None) not in neutral:
            raise _conflict(name)
    if fields.get("logprobs") is not None:
        raise _conflict("logprobs")
    constraint = fields.get("structured_outputs")
    if constraint is not None:
        raise _conflict(constraint.source.split(".")[0])


def new_beam_search(
    request: SamplingFields, engine_request: EngineRequest, eos_token_ids: Iterable[int]
) -> BeamSearch:
    """The search ``request`` asks for, from its processed ``engine_request`` (its prompt, ``n``
    and resolved ``max_tokens``).

    Raises:
        OpenAIError: 400 naming ``n`` (a beam width beyond what the candidates allow) or
            ``length_penalty``.
    """
    params = engine_request.sampling_params
    try:
        return BeamSearch(
            engine_request.prompt_token_ids,
            BeamSearchParams(
                beam_width=params.n,
                max_tokens=params.max_tokens,
                ignore_eos=params.ignore_eos,
                length_penalty=1.0 if request.length_penalty is None else request.length_penalty,
                include_stop_str_in_output=params.include_stop_str_in_output,
            ),
            eos_token_ids,
        )
    except ValueError as exc:
        message = str(exc)
        if message.startswith("beam_width:"):
            message = "n: the beam width" + message.removeprefix("beam_width")
        raise OpenAIError(message, 400, param_from_message(message)) from exc


def _conflict(name: str) -> OpenAIError:
    return OpenAIError(
        f"{name}: cannot be combined with use_beam_search (beams are ranked by the model's "
        "log-probabilities and end only at EOS or max_tokens)",
        400,
        name,
    )
