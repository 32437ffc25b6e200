"""Cross-encoders and classifiers (``--task score`` / ``classify``) and ``/pooling``: tiny random
``BertForSequenceClassification`` checkpoints (all-MiniLM-L6-v2's tokenizer) against
transformers in float32, through ``LLM`` and a real ``pyxllm serve``."""

from __future__ import annotations

import math

import httpx
import pytest
import torch

from pyxllm.weights.embedded import embedded_embedding_model_dir
from tests.utils import RemoteServer

QUERY = "What is the capital of France?"
DOCUMENTS = [
    "Paris is the capital of France.",
    "The capital of Brazil is Brasilia, a city planned in the fifties.",
    "Cats sleep.",
]
TEXTS = ["I loved this film!", "A dull, overlong and utterly forgettable afternoon.", "ok"]
LABELS = {0: "negative", 1: "neutral", 2: "positive"}
TOL = 1e-5
IDENTITY = "torch.nn.modules.linear.Identity"

pytestmark = pytest.mark.usefixtures("one_thread")


def build_classifier(path, num_labels: int):
    """A tiny random ``BertForSequenceClassification`` saved with all-MiniLM-L6-v2's tokenizer
    (weights drawn wide so that scores spread over (0, 1) and token types matter)."""
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    tokenizer = AutoTokenizer.from_pretrained(embedded_embedding_model_dir())
    config = BertConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=128,
        initializer_range=0.5,
        num_labels=num_labels,
        id2label=LABELS if num_labels == 3 else None,
    )
    torch.manual_seed(num_labels)
    model = BertForSequenceClassification(config).eval()
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return model, tokenizer


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory):
    """``(path, reference)``: ``reference(pairs, token_types=True) -> float32 [len(pairs)]``,
    transformers' sigmoid(logit) of each pair tokenized as a pair."""
    path = tmp_path_factory.mktemp("cross-encoder")
    model, tokenizer = build_classifier(path, 1)

    def reference(pairs, token_types=True):
        scores = []
        for a, b in pairs:
            batch = tokenizer(a, b, return_tensors="pt")
            if not token_types:
                batch["token_type_ids"].zero_()
            with torch.no_grad():
                scores.append(torch.sigmoid(model(**batch).logits[0, 0]).item())
        return scores

    return str(path), reference


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    """``(path, reference)``: ``reference(texts) -> float32 [len(texts), 3]``, softmax of
    transformers' logits."""
    path = tmp_path_factory.mktemp("classifier")
    model, tokenizer = build_classifier(path, 3)

    def reference(texts):
        batch = tokenizer(texts, padding=True, return_tensors="pt")
        with torch.no_grad():
            return torch.softmax(model(**batch).logits, dim=-1)

    return str(path), reference


@pytest.fixture(scope="module")
def server(cross_encoder):
    with RemoteServer([cross_encoder[0], "--max-seqs-per-batch", "8"]) as remote:
        yield remote


def test_llm_score_equals_transformers(cross_encoder):
    """``LLM.score`` under ``task="auto"`` (a one-label classifier is a cross-encoder): 1 to N
    and pairwise, pairs of different lengths in one step, each sigmoid(logit) of the pair with
    its token types (which change the score: the test would see them dropped)."""
    from pyxllm import LLM

    path, reference = cross_encoder
    llm = LLM(path)
    assert llm.llm_engine.config.task == "score"
    pairs = [(QUERY, d) for d in DOCUMENTS]
    want = reference(pairs)
    assert max(abs(a - b) for a, b in zip(want, reference(pairs, token_types=False))) > 1e-3
    outputs = llm.score(QUERY, DOCUMENTS)
    for output, expected, (a, b) in zip(outputs, want, pairs):
        assert math.isclose(output.outputs.score, expected, abs_tol=TOL)
        assert output.prompt_token_ids == llm.get_tokenizer().hf(a, b)["input_ids"]
    pairwise = llm.score(DOCUMENTS[:2], DOCUMENTS[1:])
    for output, expected in zip(pairwise, reference(list(zip(DOCUMENTS[:2], DOCUMENTS[1:])))):
        assert math.isclose(output.outputs.score, expected, abs_tol=TOL)
    with pytest.raises(ValueError, match="text_2"):
        llm.score(QUERY, [])
    with pytest.raises(ValueError, match="embed"):
        llm.embed("hi")
    with pytest.raises(ValueError, match="score"):
        llm.generate("hi")


def test_llm_classify_and_encode_equal_softmax(classifier):
    """A three-label classifier: ``task="auto"`` classifies; ``probs`` and ``LLM.encode``'s
    data are the softmax of transformers' logits; scoring pairs with it is refused."""
    from pyxllm import LLM
    from pyxllm.pooling_params import PoolingParams

    path, reference = classifier
    llm = LLM(path)
    assert llm.llm_engine.config.task == "classify"
    assert llm.llm_engine.input_processor.class_labels == tuple(LABELS.values())
    want = reference(TEXTS)
    for output, expected in zip(llm.classify(TEXTS), want):
        assert output.outputs.num_classes == 3
        assert torch.allclose(torch.tensor(output.outputs.probs), expected, atol=TOL)
    for output, expected in zip(llm.encode(TEXTS), want):
        assert torch.allclose(output.outputs.data, expected, atol=TOL)
    with pytest.raises(ValueError, match="one label"):
        llm.score("a", "b")
    with pytest.raises(ValueError, match="dimensions: applies to embedding models"):
        llm.encode(TEXTS, PoolingParams(dimensions=2))


def test_task_checks_name_the_task(cross_encoder):
    from pyxllm import LLM

    path, _ = cross_encoder
    with pytest.raises(ValueError, match="--task score"):
        LLM(path, task="generate")
    with pytest.raises(ValueError, match="--task embed: .* is a classifier"):
        LLM(path, task="embed")
    with pytest.raises(ValueError, match="--task score: .* no classification head"):
        LLM(str(embedded_embedding_model_dir()), task="score")
    with pytest.raises(ValueError, match="--quantization"):
        LLM(path, quantization="int8")


def test_score_route_equals_transformers(server, cross_encoder):
    _, reference = cross_encoder
    for path in ("v1/score", "score"):
        body = {"text_1": QUERY, "text_2": DOCUMENTS}
        response = httpx.post(server.url_for(path), json=body, timeout=60)
        assert response.status_code == 200, response.text
        data = response.json()["data"]
        assert [d["index"] for d in data] == [0, 1, 2]
        for item, expected in zip(data, reference([(QUERY, d) for d in DOCUMENTS])):
            assert math.isclose(item["score"], expected, abs_tol=TOL)


def test_rerank_route_orders_by_cross_encoder(server, cross_encoder):
    _, reference = cross_encoder
    scores = reference([(QUERY, d) for d in DOCUMENTS])
    want = sorted(range(3), key=lambda i: -scores[i])
    for path in ("v1/rerank", "rerank", "v2/rerank"):
        body = {"query": QUERY, "documents": DOCUMENTS, "top_n": 2}
        response = httpx.post(server.url_for(path), json=body, timeout=60).json()
        assert [r["index"] for r in response["results"]] == want[:2]
        for result in response["results"]:
            assert result["document"]["text"] == DOCUMENTS[result["index"]]
            assert math.isclose(result["relevance_score"], scores[result["index"]], abs_tol=TOL)


def test_text_routes_name_the_scoring_routes(server):
    body = {"prompt": "hi", "max_tokens": 2}
    response = httpx.post(server.url_for("v1/completions"), json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert "--task score, which makes scores" in response.json()["error"]["message"]
    assert "/v1/rerank" in response.json()["error"]["message"]


def test_classify_route_on_the_cross_encoder(server, cross_encoder):
    """``/classify`` on a one-label model: its one probability is the pair-less score."""
    response = httpx.post(server.url_for("classify"), json={"input": TEXTS[:2]}, timeout=60)
    assert response.status_code == 200, response.text
    data = response.json()["data"]
    assert [(d["index"], d["num_classes"], d["label"]) for d in data] == [
        (0, 1, "LABEL_0"),
        (1, 1, "LABEL_0"),
    ]
    assert all(0 < d["probs"][0] < 1 for d in data)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("v1/score", {"text_1": [], "text_2": "x"}, "text_1"),
        ("v1/score", {"text_1": "a", "text_2": ["b", ""]}, "text_2"),
        ("v1/rerank", {"query": "q", "documents": []}, "documents"),
        ("classify", {"input": []}, "input"),
        ("classify", {"input": "hi", "dimensions": 2}, "dimensions"),
        ("pooling", {"input": ""}, "input"),
        ("v1/embeddings", {"input": "hi"}, "model"),
        ("v1/rerank", {"query": "q", "documents": ["word " * 200]}, "documents"),
        ("v1/score", {"text_1": "q", "text_2": "word " * 200}, "text_2"),
    ],
)
def test_bad_requests_name_the_field(server, path, body, param):
    response = httpx.post(server.url_for(path), json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_classify_route_equals_softmax(classifier):
    """``/classify`` on a three-label classifier (the app in this process): ``probs`` are the
    softmax of transformers' logits, ``label`` the most probable one's ``id2label`` name;
    ``/pooling`` gives the same probabilities; ``/v1/score`` is refused, naming ``model``."""
    from fastapi.testclient import TestClient

    from pyxllm import LLM
    from pyxllm.engine.async_engine import AsyncEngine
    from pyxllm.entrypoints.openai.api_server import build_app
    from pyxllm.entrypoints.openai.server_options import ServerOptions

    path, reference = classifier
    want = reference(TEXTS)
    engine = AsyncEngine(LLM(path).llm_engine)
    try:
        with TestClient(build_app(engine, ServerOptions())) as client:
            response = client.post("/classify", json={"input": TEXTS})
            assert response.status_code == 200, response.text
            body = response.json()
            assert body["usage"]["prompt_tokens"] == sum(
                len(ids) for ids in engine.tokenizer.hf(TEXTS)["input_ids"]
            )
            for item, expected in zip(body["data"], want):
                assert item["num_classes"] == 3
                assert torch.allclose(torch.tensor(item["probs"]), expected, atol=TOL)
                assert item["label"] == LABELS[int(expected.argmax())]
            pooled = client.post("/pooling", json={"input": TEXTS}).json()
            for item, expected in zip(pooled["data"], want):
                assert item["object"] == "pooling"
                assert torch.allclose(torch.tensor(item["data"]), expected, atol=TOL)
            refused = client.post("/v1/score", json={"text_1": "a", "text_2": "b"})
            assert refused.status_code == 400, refused.text
            assert refused.json()["error"]["param"] == "model"
            assert "/classify" in refused.json()["error"]["message"]
    finally:
        engine.shutdown()


def test_generation_server_refuses_the_pooling_routes():
    from tests.utils import stub_app_client

    client = stub_app_client()
    for path, body in (("/classify", {"input": "hi"}), ("/pooling", {"input": "hi"})):
        response = client.post(path, json={"model": "m", **body})
        assert response.status_code == 400, response.text
        assert path in response.json()["error"]["message"]
        assert response.json()["error"]["param"] == "model"


@pytest.mark.parametrize(
    ("config", "task", "want"),
    [
        ({"num_labels": 1}, "score", "sigmoid"),
        ({"num_labels": 3}, "classify", "softmax"),
        ({"num_labels": 1, "problem_type": "regression"}, "classify", "identity"),
        ({"num_labels": 3, "problem_type": "multi_label_classification"}, "classify", "sigmoid"),
        (
            {
                "num_labels": 1,
                "sbert_ce_default_activation_function": "torch.nn.modules.linear.Identity",
            },
            "score",
            "identity",
        ),
        (
            {
                "num_labels": 1,
                "sentence_transformers": {"activation_fn": "torch.nn.modules.activation.Sigmoid"},
            },
            "score",
            "sigmoid",
        ),
    ],
)
def test_classifier_activation_is_vllms(config, task, want):
    """The activation of a classifier's logits: sentence-transformers' for a cross-encoder's
    score, else by ``problem_type`` and the label count (vLLM's choices)."""
    from types import SimpleNamespace

    from pyxllm.layers.pooler import classifier_activation

    assert classifier_activation(SimpleNamespace(**config), task) == want


def test_classifier_activation_refuses_other_modules():
    from types import SimpleNamespace

    from pyxllm.layers.pooler import classifier_activation

    config = SimpleNamespace(num_labels=1, sbert_ce_default_activation_function="os.system")
    with pytest.raises(ValueError, match="os.system"):
        classifier_activation(config, "score")
