"""Structured outputs over HTTP, with the real ``openai`` SDK against ``pyxllm serve`` on the
default model: ``response_format`` (``json_object``, ``json_schema``, the SDK's ``parse``),
vLLM's ``structured_outputs``, streamed or not, and the 400s of constraints that cannot work."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest
from pydantic import BaseModel, Field

from tests.utils import RemoteServer, run_together

MODEL = "smollm2-structured"
ASK = [{"role": "user", "content": "Tell me about a city as JSON."}]
CITY = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "country": {"type": "string", "maxLength": 24},
        "population": {"type": "integer", "minimum": 0},
        "coastal": {"type": "boolean"},
        "landmarks": {"type": "array", "items": {"type": "string", "maxLength": 24}, "maxItems": 2},
        "climate": {"enum": ["cold", "mild", "hot"]},
    },
    "required": ["name", "country", "population", "coastal", "landmarks", "climate"],
    "additionalProperties": False,
}


class City(BaseModel):
    name: str = Field(max_length=24)
    country: str = Field(max_length=24)
    population: int = Field(ge=0)


@pytest.fixture(scope="module")
def server():
    args = ["--served-model-name", MODEL, "--max-model-len", "1024", "--kv-cache-memory", "0.25"]
    with RemoteServer(args) as remote:
        yield remote


@pytest.fixture(scope="module")
def client(server):
    return server.openai_client()


def post(server: RemoteServer, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url_for("v1", path), json={"model": MODEL, **body}, timeout=120)


def test_parse_returns_the_pydantic_object(client):
    completion = client.beta.chat.completions.parse(
        model=MODEL, messages=ASK, response_format=City, temperature=0, max_tokens=120
    )
    city = completion.choices[0].message.parsed
    assert isinstance(city, City) and city.population >= 0


def test_json_schema_output_validates_streamed_or_not(client):
    response_format = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}}
    body = dict(model=MODEL, messages=ASK, response_format=response_format, temperature=0)
    body["max_tokens"] = 200
    full, chunks = run_together(
        lambda: client.chat.completions.create(**body),
        lambda: list(client.chat.completions.create(**body, stream=True)),
    )
    text = full.choices[0].message.content
    assert full.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(text), CITY)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text


def test_json_object_on_completions(server):
    body = {
        "prompt": "A JSON object describing a dog:",
        "max_tokens": 80,
        "temperature": 0,
        "response_format": {"type": "json_object"},
    }
    choice = post(server, "completions", body).json()["choices"][0]
    if choice["finish_reason"] == "stop":
        assert isinstance(json.loads(choice["text"]), dict)
    else:
        assert choice["text"].lstrip().startswith("{")


@pytest.mark.parametrize("path", ["chat/completions", "completions"])
def test_vllm_structured_outputs_regex_and_choice(server, path):
    prompt = {"messages": ASK} if path == "chat/completions" else {"prompt": "Answer: "}
    regex = post(
        server,
        path,
        {
            **prompt,
            "max_tokens": 30,
            "temperature": 1.0,
            "seed": 4,
            "structured_outputs": {"regex": r"[A-Z][a-z]{2,8} [0-9]{2}"},
        },
    )
    text = regex.json()["choices"][0]
    text = text["message"]["content"] if "message" in text else text["text"]
    assert re.fullmatch(r"[A-Z][a-z]{2,8} [0-9]{2}", text), text
    choice = post(
        server,
        path,
        {
            **prompt,
            "max_tokens": 10,
            "temperature": 0,
            "structured_outputs": {"choice": ["red", "green"]},
        },
    )
    first = choice.json()["choices"][0]
    assert (first["message"]["content"] if "message" in first else first["text"]) in (
        "red",
        "green",
    )


def test_the_older_guided_fields_work_too(server):
    body = {"messages": ASK, "max_tokens": 10, "temperature": 0, "guided_choice": ["up", "down"]}
    assert post(server, "chat/completions", body).json()["choices"][0]["message"]["content"] in (
        "up",
        "down",
    )


@pytest.mark.parametrize(
    "body, param",
    [
        ({"response_format": {"type": "sound"}}, "response_format"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format.json_schema.schema",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "x",
                        "schema": {"type": "object", "properties": {"a": {"type": "nope"}}},
                    },
                }
            },
            "response_format.json_schema.schema",
        ),
        ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
        ({"structured_outputs": {"grammar": "start: missing"}}, "structured_outputs.grammar"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"structured_outputs": {"regexp": "a"}}, "structured_outputs"),
        (
            {"structured_outputs": {"choice": ["a"]}, "response_format": {"type": "json_object"}},
            "structured_outputs",
        ),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_a_constraint_that_cannot_work_is_a_400_before_any_token(server, body, param, stream):
    response = post(
        server, "chat/completions", {"messages": ASK, "max_tokens": 4, "stream": stream, **body}
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    stats = httpx.get(server.url_for("debug", "stats")).json()
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0
