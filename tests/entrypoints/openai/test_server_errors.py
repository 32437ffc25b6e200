"""Bad requests get a 4xx in OpenAI's error shape, and the server keeps serving afterwards."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.utils import RemoteServer

MODEL_NAME = "smollm2-errors"
MAX_MODEL_LEN = 256
HELLO = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def server():
    args = [
        "--served-model-name",
        MODEL_NAME,
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--kv-cache-memory",
        "0.25",
    ]
    with RemoteServer(args) as remote:
        yield remote


@pytest.fixture(autouse=True)
def still_serving(server):
    """After each test, the server answers a normal request."""
    yield
    body = {"model": MODEL_NAME, "messages": HELLO, "max_tokens": 2}
    response = httpx.post(server.url_for("v1", "chat", "completions"), json=body, timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] is not None


def post(server: RemoteServer, path: str, **kwargs) -> httpx.Response:
    return httpx.post(server.url_for("v1", path), timeout=60, **kwargs)


def assert_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    """Check the one error shape; return its ``error`` object."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status and error["message"]
    assert error["type"] == {400: "BadRequestError", 404: "NotFoundError"}[status]
    if param is not None:
        assert error["param"] == param, error
    return error


@pytest.mark.parametrize("path", ["chat/completions", "completions"])
def test_malformed_json(server, path):
    response = post(
        server,
        path,
        content=b'{"model": "x", "messages": [',
        headers={"content-type": "application/json"},
    )
    assert "JSON" in assert_error(response, 400)["message"]


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("chat/completions", {"messages": HELLO, "max_tokens": "many"}, "max_tokens"),
        ("chat/completions", {"messages": "Hello"}, "messages"),
        ("chat/completions", {"messages": HELLO, "temperature": "hot"}, "temperature"),
        ("chat/completions", {"messages": HELLO, "stop": 7}, "stop"),
        ("chat/completions", {"max_tokens": 2}, "messages"),
        ("completions", {"prompt": 42}, "prompt"),
        ("completions", {"prompt": "Hi", "stream": "sometimes"}, "stream"),
    ],
)
def test_wrong_field_types(server, path, body, param):
    assert_error(post(server, path, json=body), 400, param)


def test_body_not_an_object(server):
    assert_error(post(server, "completions", json=["Hello"]), 400)


@pytest.mark.parametrize(
    "path, body",
    [
        ("chat/completions", {"model": "gpt-4o", "messages": HELLO, "max_tokens": 2}),
        ("completions", {"model": "gpt-4o", "prompt": "Hi", "max_tokens": 2}),
    ],
)
def test_unknown_model(server, path, body):
    assert "gpt-4o" in assert_error(post(server, path, json=body), 404, "model")["message"]


def test_unknown_model_with_sdk(server):
    with pytest.raises(openai.NotFoundError):
        server.openai_client().chat.completions.create(model="gpt-4o", messages=HELLO, max_tokens=2)


def test_unknown_route(server):
    response = httpx.get(server.url_for("v1", "nothing-here"))
    assert_error(response, 404)


@pytest.mark.parametrize(
    "path, key, value",
    [
        ("chat/completions", "messages", [{"role": "user", "content": "hello " * 200}]),
        ("completions", "prompt", "hello " * 200),
    ],
)
def test_prompt_plus_max_tokens_too_long(server, path, key, value):
    response = post(server, path, json={"model": MODEL_NAME, key: value, "max_tokens": 100})
    message = assert_error(response, 400)["message"]
    assert "max_model_len" in message and str(MAX_MODEL_LEN) in message
    assert "100" in message


def test_prompt_alone_too_long(server):
    body = {"model": MODEL_NAME, "prompt": "hello " * 400}
    message = assert_error(post(server, "completions", json=body), 400, "prompt")["message"]
    assert "max_model_len" in message and str(MAX_MODEL_LEN) in message


@pytest.mark.parametrize("prompt", ["", [], [[]]])
def test_empty_prompt(server, prompt):
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 2}
    assert_error(post(server, "completions", json=body), 400, "prompt")


def test_empty_messages(server):
    body = {"model": MODEL_NAME, "messages": [], "max_tokens": 2}
    assert_error(post(server, "chat/completions", json=body), 400, "messages")


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", -1),
        ("top_p", 0),
        ("top_p", 1.5),
        ("max_tokens", 0),
        ("n", 0),
        ("frequency_penalty", -3),
        ("logit_bias", {"1": -101}),
        ("min_p", -0.1),
    ],
)
@pytest.mark.parametrize("path", ["chat/completions", "completions"])
def test_invalid_sampling_values(server, path, field, value):
    body = {"model": MODEL_NAME, "max_tokens": 2, field: value}
    body.update({"messages": HELLO} if path == "chat/completions" else {"prompt": "Hi"})
    assert_error(post(server, path, json=body), 400, field)


def test_invalid_sampling_with_sdk(server):
    client = server.openai_client()
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL_NAME, messages=HELLO, temperature=-1, max_tokens=2
        )
    assert info.value.status_code == 400


def test_invalid_in_stream_request(server):
    body = {"model": MODEL_NAME, "messages": HELLO, "top_p": 0, "stream": True}
    assert_error(post(server, "chat/completions", json=body), 400, "top_p")


@pytest.mark.parametrize(
    "path, field, value",
    [
        ("completions", "best_of", 3),
        ("completions", "prompt_logprobs", 1),
        ("chat/completions", "guided_decoding_backend", "outlines"),
        ("completions", "guided_whitespace_pattern", " *"),
    ],
)
def test_a_field_pyxllm_cannot_honour_is_refused_by_name(server, path, field, value):
    body = {"model": MODEL_NAME, "max_tokens": 2, field: value}
    body.update({"messages": HELLO} if path == "chat/completions" else {"prompt": "Hi"})
    assert field in assert_error(post(server, path, json=body), 400, field)["message"]


def test_fields_left_at_their_neutral_value_are_accepted(server):
    body = {"model": MODEL_NAME, "messages": HELLO, "max_tokens": 2, "n": 2, "best_of": 2}
    body.update(response_format={"type": "text"}, tool_choice="none")
    response = post(server, "chat/completions", json=body)
    assert response.status_code == 200, response.text


def test_kv_transfer_params_is_refused_by_a_server_that_moves_no_kv(server):
    """vLLM's prefill/decode field on each API's route of a server started without
    --kv-offload-dir (nothing in it would act on the field): a 400 naming it, in the route's
    error shape (tests/engine/test_kv_disagg.py shows the instances of a split set-up taking
    it)."""
    params = {"do_remote_decode": True, "remote_host": "10.0.0.2", "remote_port": 8300}
    for path, body in (
        ("completions", {"prompt": "Hi", "max_tokens": 2}),
        ("chat/completions", {"messages": HELLO, "max_tokens": 2}),
        ("responses", {"input": "Hi", "max_output_tokens": 2}),
    ):
        body.update(model=MODEL_NAME, kv_transfer_params=params)
        error = assert_error(post(server, path, json=body), 400, "kv_transfer_params")
        assert error["message"].startswith("kv_transfer_params: this server moves no KV"), path
    body = {"model": MODEL_NAME, "messages": HELLO, "max_tokens": 2, "kv_transfer_params": params}
    response = post(server, "messages", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["type"] == "error"  # Anthropic's shape on Anthropic's route
    message = response.json()["error"]["message"]
    assert message.startswith("kv_transfer_params: this server moves no KV"), message


def test_continuous_usage_stats_is_refused(server):
    body = {"model": MODEL_NAME, "messages": HELLO, "max_tokens": 2, "stream": True}
    body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    assert_error(post(server, "chat/completions", json=body), 400, "stream_options")


def test_a_chat_too_long_for_max_completion_tokens_names_that_field(server):
    body = {"model": MODEL_NAME, "messages": HELLO, "max_completion_tokens": MAX_MODEL_LEN}
    message = assert_error(
        post(server, "chat/completions", json=body), 400, "max_completion_tokens"
    )["message"]
    assert "lower max_completion_tokens" in message


def test_a_completion_without_max_tokens_stops_at_16_as_in_openai(server):
    body = {"model": MODEL_NAME, "prompt": "Count:", "ignore_eos": True}
    response = post(server, "completions", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 16
    assert response.json()["choices"][0]["finish_reason"] == "length"
