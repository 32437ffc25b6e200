"""The constraint an OpenAI request asks for, as a :class:`StructuredOutputsParams`.

Sources, at most one per request: OpenAI's ``response_format`` (``json_object``, or
``json_schema`` with its ``schema``; ``text`` is no constraint), vLLM's ``structured_outputs``
object, vLLM's older ``guided_json`` / ``guided_regex`` / ``guided_choice`` /
``guided_grammar``, and llama.cpp's top-level ``json_schema`` (a JSON Schema) and ``grammar``
(GBNF, which llguidance reads as it reads Lark). Each constraint remembers the request field
it came from, so a schema or regex that does not compile gets a 400 naming that field
(``response_format.json_schema.schema``, ``structured_outputs.regex``, ``grammar`` ...).
"""

from __future__ import annotations

from pyxllm.entrypoints.openai.errors import OpenAIError
from pyxllm.entrypoints.openai.protocol import SamplingFields
from pyxllm.sampling_params import StructuredOutputsParams

# the request fields that spell one kind of structured_outputs each: vLLM's older names and
# llama.cpp's
_GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
    "json_schema": "json",
    "grammar": "grammar",
}


def requested_constraint(request: SamplingFields) -> StructuredOutputsParams | None:
    """The request's constraint, ``None`` when it asks for free text.

    Raises:
        OpenAIError: several sources given, a ``json_schema`` format without its ``schema``, or
            a ``structured_outputs`` object with none or several kinds (400 naming the field).
    """
    found = [c for c in (_response_format(request), _structured(request), *_guided(request)) if c]
    if len(found) > 1:
        fields = ", ".join(c.source.split(".")[0] for c in found)
        second = found[1].source.split(".")[0]
        raise OpenAIError(f"{fields}: give at most one output constraint", 400, second)
    return found[0] if found else None


def _response_format(request: SamplingFields) -> StructuredOutputsParams | None:
    response_format = request.response_format
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return StructuredOutputsParams(json_object=True, field="response_format")
    schema = response_format.json_schema and response_format.json_schema.json_schema
    if schema is None:
        raise OpenAIError(
            "response_format.json_schema.schema: required for type json_schema",
            400,
            "response_format.json_schema.schema",
        )
    return StructuredOutputsParams(json=schema, field="response_format.json_schema.schema")


def _structured(request: SamplingFields) -> StructuredOutputsParams | None:
    spec = request.structured_outputs
    if spec is None:
        return None
    fields = spec.model_dump(by_alias=True, exclude_none=True)
    compact = fields.pop("disable_any_whitespace")
    field = f"structured_outputs.{next(iter(fields))}" if len(fields) == 1 else None
    try:
        return StructuredOutputsParams(**fields, disable_any_whitespace=compact, field=field)
    except ValueError as exc:
        raise OpenAIError(str(exc), 400, "structured_outputs") from exc


def _guided(request: SamplingFields):
    for name, kind in _GUIDED.items():
        value = getattr(request, name)
        if value is not None:
            try:
                yield StructuredOutputsParams(**{kind: value}, field=name)
            except ValueError as exc:
                raise OpenAIError(str(exc), 400, name) from exc
