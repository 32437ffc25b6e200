"""Hugging Face model ids (``--model ORG/NAME``, ``pyxllm serve ORG/NAME``), ``--gguf-file``
and ``--tokenizer``: resolved from a Hugging Face cache the test writes in the hub's own layout
(``models--ORG--NAME/refs/main`` and ``snapshots/<commit>/``), offline; a missing id or file
fails with one line naming it and where it was looked for."""

from __future__ import annotations

import copy
import json

import huggingface_hub.constants
import pytest

from pyxllm import LLM, SamplingParams
from pyxllm.cli.main import parse_args
from pyxllm.weights import load_hf_tokenizer, resolve_model_source, resolve_tokenizer_source
from pyxllm.weights.errors import ModelLoadError
from tests.model_fixtures import build_checkpoint

COMMIT = "0123456789abcdef0123456789abcdef01234567"
# a chat template no model here has, to tell which tokenizer was loaded
MARKED_TEMPLATE = "{% for m in messages %}[[{{ m['content'] }}]]{% endfor %}"
SMALL = {"dtype": "float32", "max_model_len": 64, "kv_cache_memory": 0.05}


def _snapshot(cache, repo_id: str):
    """``models--ORG--NAME`` with ``refs/main`` naming ``COMMIT``; returns its empty snapshot."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    return snapshot


@pytest.fixture
def hub_cache(tmp_path, hf_gguf_tokenizer, monkeypatch):
    """A cache holding ``tiny-org/tiny-llama`` (a random tiny Llama) at main; offline."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    snapshot = _snapshot(tmp_path, "tiny-org/tiny-llama")
    snapshot, model = build_checkpoint("llama", snapshot, hf_gguf_tokenizer)
    return tmp_path, snapshot, model


@pytest.fixture
def marked_tokenizer(hub_cache, hf_gguf_tokenizer):
    """The SmolLM2 tokenizer with ``MARKED_TEMPLATE``, saved as the tokenizer-only repository
    ``tiny-org/marked-tokenizer`` in the cache (and so also a local directory)."""
    cache = hub_cache[0]
    tokenizer = copy.deepcopy(hf_gguf_tokenizer)
    tokenizer.chat_template = MARKED_TEMPLATE
    snapshot = _snapshot(cache, "tiny-org/marked-tokenizer")
    tokenizer.save_pretrained(snapshot)
    return snapshot


@pytest.fixture
def gguf_repo(hub_cache, default_gguf_path):
    """``tiny-org/smollm2-gguf``: the default GGUF (linked) beside a config.json, as GGUF
    repositories hold it."""
    snapshot = _snapshot(hub_cache[0], "tiny-org/smollm2-gguf")
    (snapshot / default_gguf_path.name).symlink_to(default_gguf_path)
    (snapshot / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return snapshot


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


def test_a_gguf_file_inside_a_model_id_or_directory_is_the_model(hub_cache, gguf_repo):
    cache, _, _ = hub_cache
    name = next(gguf_repo.glob("*.gguf")).name
    source = resolve_model_source("tiny-org/smollm2-gguf", download_dir=str(cache), gguf_file=name)
    assert (source.kind, source.path, source.name) == (
        "gguf",
        gguf_repo / name,
        "tiny-org/smollm2-gguf",
    )
    local = resolve_model_source(str(gguf_repo), gguf_file=name)
    assert (local.kind, local.path, local.name) == ("gguf", gguf_repo / name, name[: -len(".gguf")])


def test_a_missing_gguf_file_names_it_and_lists_the_ones_there(hub_cache, gguf_repo):
    cache, _, _ = hub_cache
    name = next(gguf_repo.glob("*.gguf")).name
    for model in ("tiny-org/smollm2-gguf", str(gguf_repo)):
        with pytest.raises(ModelLoadError) as info:
            resolve_model_source(model, download_dir=str(cache), gguf_file="absent.Q8_0.gguf")
        message = str(info.value)
        assert "'absent.Q8_0.gguf'" in message and name in message and "\n" not in message
    with pytest.raises(ModelLoadError, match="neither a directory nor a Hugging Face model id"):
        resolve_model_source(str(cache / "nowhere"), gguf_file=name)


def test_a_tokenizer_id_resolves_from_the_cache_and_a_missing_one_names_the_cache(
    hub_cache, marked_tokenizer
):
    cache, _, _ = hub_cache
    source = resolve_tokenizer_source("tiny-org/marked-tokenizer", download_dir=str(cache))
    assert (source.kind, source.path) == ("hf", marked_tokenizer)
    assert load_hf_tokenizer(source).chat_template == MARKED_TEMPLATE
    with pytest.raises(ModelLoadError) as info:
        resolve_tokenizer_source("tiny-org/absent", "v2", download_dir=str(cache))
    message = str(info.value)
    assert message.startswith("Tokenizer 'tiny-org/absent' (revision v2)")
    assert str(cache) in message and "HF_HUB_OFFLINE" in message and "\n" not in message


def test_the_tokenizer_flag_replaces_the_models_tokenizer(hub_cache, marked_tokenizer):
    cache, _, _ = hub_cache
    chat = [{"role": "user", "content": "Hi"}]
    for tokenizer in (str(marked_tokenizer), "tiny-org/marked-tokenizer"):
        llm = LLM("tiny-org/tiny-llama", tokenizer=tokenizer, download_dir=str(cache), **SMALL)
        assert llm.get_tokenizer().hf.chat_template == MARKED_TEMPLATE
        ids = llm.chat(chat, SamplingParams(temperature=0, max_tokens=1))[0].prompt_token_ids
        assert llm.get_tokenizer().hf.decode(ids) == "[[Hi]]"


def test_a_gguf_from_a_model_id_runs_with_the_tokenizer_flag(
    hub_cache, gguf_repo, marked_tokenizer
):
    cache, _, _ = hub_cache
    name = next(gguf_repo.glob("*.gguf")).name
    llm = LLM(
        "tiny-org/smollm2-gguf",
        gguf_file=name,
        tokenizer="tiny-org/marked-tokenizer",
        download_dir=str(cache),
        **SMALL,
    )
    assert llm.llm_engine.model_name == "tiny-org/smollm2-gguf"
    assert llm.get_tokenizer().hf.chat_template == MARKED_TEMPLATE  # not the GGUF's own
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=2))
    assert len(out[0].outputs[0].token_ids) == 2


def test_the_source_flags_parse_and_misuse_is_a_usage_error():
    argv = ["serve", "a/b", "--gguf-file", "m.Q4_K_M.gguf", "--tokenizer", "c/d"]
    _, config = parse_args([*argv, "--tokenizer-revision", "v2"])
    assert (config.model, config.gguf_file) == ("a/b", "m.Q4_K_M.gguf")
    assert (config.tokenizer, config.tokenizer_revision) == ("c/d", "v2")
    for bad in (["serve", "--gguf-file", "m.gguf"], ["serve", "--tokenizer-revision", "v2"]):
        with pytest.raises(SystemExit):
            parse_args(bad)
