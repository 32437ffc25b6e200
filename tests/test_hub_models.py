"""Hugging Face model ids (``--model ORG/NAME``, ``pyxllm serve ORG/NAME``): resolved from a
Hugging Face cache the test writes in the hub's own layout
(``models--ORG--NAME/refs/main`` and ``snapshots/<commit>/``), offline; a missing id fails with
one line naming it and the cache."""

from __future__ import annotations

import huggingface_hub.constants
import pytest

from pyxllm import LLM, SamplingParams
from pyxllm.entrypoints.args import parse_args
from pyxllm.weights import resolve_model_source
from pyxllm.weights.errors import ModelLoadError
from tests.model_fixtures import build_checkpoint

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hub_cache(tmp_path, hf_gguf_tokenizer, monkeypatch):
    """A cache holding ``tiny-org/tiny-llama`` (a random tiny Llama) at main; offline."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    repo = tmp_path / "models--tiny-org--tiny-llama"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    snapshot, model = build_checkpoint("llama", repo / "snapshots" / COMMIT, hf_gguf_tokenizer)
    return tmp_path, snapshot, model


def test_a_model_id_resolves_from_the_cache_offline(hub_cache):
    cache, snapshot, _ = hub_cache
    source = resolve_model_source("tiny-org/tiny-llama", download_dir=str(cache))
    assert (source.kind, source.path, source.name) == ("hf", snapshot, "tiny-org/tiny-llama")
    pinned = resolve_model_source("tiny-org/tiny-llama", COMMIT, download_dir=str(cache))
    assert pinned.path == snapshot


def test_a_model_id_runs_and_is_served_under_its_id(hub_cache):
    cache, snapshot, _ = hub_cache
    llm = LLM(
        "tiny-org/tiny-llama",
        download_dir=str(cache),
        dtype="float32",
        max_model_len=64,
        kv_cache_memory=0.05,
    )
    by_path = LLM(str(snapshot), dtype="float32", max_model_len=64, kv_cache_memory=0.05)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    assert llm.llm_engine.model_name == "tiny-org/tiny-llama"
    tokens = [o.outputs[0].token_ids for o in llm.generate(["Hello there"], params)]
    assert tokens == [o.outputs[0].token_ids for o in by_path.generate(["Hello there"], params)]


def test_a_missing_id_names_the_id_and_the_cache(hub_cache):
    cache, _, _ = hub_cache
    with pytest.raises(ModelLoadError) as info:
        resolve_model_source("tiny-org/absent", download_dir=str(cache))
    message = str(info.value)
    assert "'tiny-org/absent'" in message and str(cache) in message and "\n" not in message


def test_serve_takes_the_model_as_its_first_argument():
    args, config = parse_args(["serve", "tiny-org/tiny-llama", "--revision", "v1"])
    assert (config.model, config.revision) == ("tiny-org/tiny-llama", "v1")
    _, same = parse_args(["serve", "a/b", "--model", "a/b"])
    assert same.model == "a/b"
    with pytest.raises(SystemExit):
        parse_args(["serve", "a/b", "--model", "c/d"])
