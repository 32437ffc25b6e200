"""LLaVA end to end on a tiny random checkpoint: greedy tokens equal transformers' float32
``generate`` on text+image prompts, with the prefix cache and chunked prefill on, in batches
with text-only requests, and through preemption; images refused by name."""

from __future__ import annotations

import httpx
import pytest

from pyxllm import LLM, SamplingParams
from pyxllm.engine.errors import InvalidRequestError
from tests.llava_fixtures import (
    IMAGE_TOKEN,
    NUM_IMAGE_TOKENS,
    build_llava,
    data_url,
    make_image,
    reference_tokens,
)
from tests.utils import RemoteServer

pytestmark = pytest.mark.usefixtures("one_thread")

MAX_TOKENS = 6
QUESTION = "What is in the picture?"
# the text the chat template renders for one image and QUESTION (string content format)
CHAT_TEXT = f"USER: {IMAGE_TOKEN}\n{QUESTION}\nASSISTANT:"
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
DATA_URL_OF_SEED_0 = data_url(make_image(0))
# the KV bytes of one 16-token block of the tiny model: 2 (K, V) x 2 layers x 16 x 2 heads x 16
BLOCK_GIB = 2 * 2 * 16 * 2 * 16 * 4 / 2**30


@pytest.fixture(scope="module")
def llava(tmp_path_factory, hf_gguf_tokenizer):
    """``(directory, hf_model, processor)`` of the tiny LLaVA."""
    return build_llava(tmp_path_factory.mktemp("llava"), hf_gguf_tokenizer)


@pytest.fixture(scope="module")
def llm(llava):
    """An engine on the defaults (prefix cache and chunked prefill on)."""
    return LLM(str(llava[0]), max_model_len=256, kv_cache_memory=64 * BLOCK_GIB)


@pytest.fixture(scope="module")
def images():
    return [make_image(0), make_image(1, (64, 48)), make_image(2)]


@pytest.fixture(scope="module")
def expected(llava, images):
    """transformers' greedy tokens for CHAT_TEXT with each image."""
    _, hf_model, processor = llava
    return [reference_tokens(hf_model, processor, CHAT_TEXT, [img], MAX_TOKENS) for img in images]


def image_chat(image, question: str = QUESTION, as_url: bool = True) -> list[dict]:
    part = (
        {"type": "image_url", "image_url": {"url": data_url(image)}}
        if as_url
        else {"type": "image_pil", "image_pil": image}
    )
    return [{"role": "user", "content": [part, {"type": "text", "text": question}]}]


def test_chat_with_an_image_equals_transformers(llm, llava, images, expected):
    _, _, processor = llava
    out = llm.chat(image_chat(images[0]), GREEDY)[0]
    assert out.outputs[0].token_ids == expected[0]
    # the placeholder run is as long as transformers' processor makes it
    want = processor(images=[images[0]], text=CHAT_TEXT, return_tensors="pt")["input_ids"]
    assert out.prompt_token_ids == want[0].tolist()
    assert out.prompt_token_ids.count(llm.llm_engine.input_processor.multimodal.image_token_id) == (
        NUM_IMAGE_TOKENS
    )
    # the image moves the tokens: another image gives others (else this test proves nothing)
    assert expected[0] != expected[1]
    pil = llm.chat(image_chat(images[1], as_url=False), GREEDY)[0]
    assert pil.outputs[0].token_ids == expected[1]


# llava-hf's LLaVA-1.5 template, which loops over a message's parts (vLLM's "openai" format)
PARTS_TEMPLATE = (
    "{% for message in messages %}{{ message['role'].upper() + ': ' }}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>\n' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ content['text'] + ' ' }}{% endfor %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)


def test_a_template_that_loops_over_parts_gets_the_parts(llava, images):
    llm = LLM(
        str(llava[0]),
        max_model_len=256,
        kv_cache_memory=64 * BLOCK_GIB,
        chat_template=PARTS_TEMPLATE,
    )
    history = [
        {"role": "user", "content": "Hello."},  # a string content becomes one text part
        {"role": "assistant", "content": "Hi."},
        *image_chat(images[0]),
    ]
    text = f"USER: Hello. ASSISTANT: Hi. USER: {IMAGE_TOKEN}\n{QUESTION} ASSISTANT:"
    want = reference_tokens(llava[1], llava[2], text, [images[0]], MAX_TOKENS)
    assert llm.chat(history, GREEDY)[0].outputs[0].token_ids == want


def test_generate_with_multi_modal_data(llm, images, expected):
    out = llm.generate({"prompt": CHAT_TEXT, "multi_modal_data": {"image": images[2]}}, GREEDY)
    assert out[0].outputs[0].token_ids == expected[2]


def test_batched_with_text_requests(llm, llava, images, expected):
    hf_model, processor = llava[1], llava[2]
    texts = ["USER: Tell me a story.\nASSISTANT:", "USER: Count to five.\nASSISTANT:"]
    text_expected = [reference_tokens(hf_model, processor, t, [], MAX_TOKENS) for t in texts]
    outs = llm.generate(
        [
            texts[0],
            {"prompt": CHAT_TEXT, "multi_modal_data": {"image": images[0]}},
            texts[1],
            {"prompt": CHAT_TEXT, "multi_modal_data": {"image": images[1]}},
        ],
        GREEDY,
    )
    got = [o.outputs[0].token_ids for o in outs]
    assert got == [text_expected[0], expected[0], text_expected[1], expected[1]]


def test_prefix_cache_hits_the_same_image_and_misses_another(llava, images, expected):
    llm = LLM(str(llava[0]), max_model_len=256, kv_cache_memory=64 * BLOCK_GIB)
    encoder = llm.llm_engine.executor.driver.encoder_cache
    first = llm.chat(image_chat(images[0]), GREEDY)[0]
    again = llm.chat(image_chat(images[0]), GREEDY)[0]
    other = llm.chat(image_chat(images[1]), GREEDY)[0]
    assert [o.outputs[0].token_ids for o in (first, again, other)] == [
        expected[0],
        expected[0],
        expected[1],
    ]
    assert first.num_cached_tokens == 0
    # the same image and text: every full block but the last token's is a hit (the image run
    # fills the first block past "USER: ")
    assert again.num_cached_tokens == (len(again.prompt_token_ids) - 1) // 16 * 16 > 0
    # the same tokens with another image: the first block holds image tokens, so nothing hits
    assert other.prompt_token_ids == first.prompt_token_ids
    assert other.num_cached_tokens == 0
    assert encoder.num_encoded == 2  # the first image was encoded once


def engine_without_prefix_cache(llava, **kwargs) -> LLM:
    """A new engine on the tiny LLaVA, the prefix cache off (every image encoded), ``kwargs``
    added."""
    return LLM(
        str(llava[0]),
        max_model_len=256,
        kv_cache_memory=64 * BLOCK_GIB,
        enable_prefix_cache=False,
        **kwargs,
    )


def test_chunked_prefill_cuts_through_the_image(llava, images, expected):
    # 5 tokens a step: the 16-token image run spans four steps, its rows sliced each time
    llm = engine_without_prefix_cache(llava, max_tokens_per_batch=5, enable_chunked_prefill=True)
    outs = llm.chat([image_chat(images[0]), image_chat(images[1])], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == expected[:2]
    assert llm.llm_engine.executor.driver.encoder_cache.num_encoded == 2


def test_the_encoder_budget_puts_a_second_image_in_the_next_step(llava, images, expected):
    """A step's encoder budget (the placeholder tokens of the images begun in it) set to one
    image: two prompts with different images arrive together, and the second one's chunk ends
    before its image, which is encoded in the next step; the tokens are unchanged."""
    llm = engine_without_prefix_cache(llava)
    llm.llm_engine.scheduler.encoder_budget = NUM_IMAGE_TOKENS
    encoder = llm.llm_engine.executor.driver.encoder_cache
    batches, encode = [], encoder._encode
    encoder._encode = lambda features: (batches.append(len(features)), encode(features))
    outs = llm.chat([image_chat(images[0]), image_chat(images[1])], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == expected[:2]
    assert batches == [1, 1]
    # with the step's token budget (the default), both images are encoded in the first step
    llm.llm_engine.scheduler.encoder_budget = llm.llm_engine.scheduler.max_tokens
    batches.clear()
    encoder.entries.clear()
    outs = llm.chat([image_chat(images[0]), image_chat(images[1])], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == expected[:2]
    assert batches == [2]


def test_two_tensor_parallel_ranks_give_transformers_tokens(llava, images, expected):
    """``--tensor-parallel-size 2``: the vision tower and projector on every rank, the
    language model split; the step plan carries each image's pixels to rank 1 until it is
    cached, then its hash alone (the second call: the same images, no prefix cache)."""
    llm = engine_without_prefix_cache(llava, tensor_parallel_size=2)
    try:
        for _ in range(2):
            outs = llm.chat([image_chat(images[0]), image_chat(images[1])], GREEDY)
            assert [o.outputs[0].token_ids for o in outs] == expected[:2]
        assert llm.llm_engine.executor.driver.encoder_cache.num_encoded == 2
    finally:
        llm.llm_engine.shutdown()


def test_preemption_recomputes_the_image(llava, images, expected):
    # 6 blocks: three prompts of 2-3 blocks each cannot all run, so some are recomputed
    llm = LLM(
        str(llava[0]),
        max_model_len=256,
        kv_cache_memory=6 * BLOCK_GIB,
        enable_prefix_cache=False,
    )
    llm.llm_engine.executor.driver.encoder_cache.max_rows = 0  # recompute the encoder too
    outs = llm.chat([image_chat(img) for img in images], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert llm.llm_engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize(
    ("part", "words"),
    [
        (  # PIL's message named its BytesIO object's address
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,aGVsbG8="}},
            r"not a readable image \(no image format PIL knows\)$",
        ),
        ({"type": "image_url", "image_url": {"url": "data:image/png;base64,@@"}}, "base64"),
        ({"type": "image_url", "image_url": {"url": "ftp://x/y.png"}}, "scheme"),
        ({"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}, "file://"),
        ({"type": "input_audio", "input_audio": {}}, "input_audio"),
    ],
)
def test_bad_image_parts_are_refused_by_name(llm, part, words):
    messages = [{"role": "user", "content": [{"type": "text", "text": "hi"}, part]}]
    with pytest.raises(InvalidRequestError, match=words) as info:
        llm.chat(messages, GREEDY)
    assert info.value.param == "messages[0].content[1]"


@pytest.fixture
def http_media(tmp_path, images):
    """``(base URL, directory)`` of an HTTP server on ``tmp_path``, which holds ``a.png``
    (``images[0]``) and ``big.png`` (a PNG of ``images[1]`` padded to 4 KiB); stopped after."""
    import functools
    import http.server
    import threading

    images[0].save(tmp_path / "a.png")
    images[1].save(tmp_path / "big.png")
    with open(tmp_path / "big.png", "ab") as f:
        f.write(b"\0" * 4096)
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", tmp_path
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_http_image_urls_are_fetched_within_a_size_limit(llm, http_media, expected, monkeypatch):
    from pyxllm.entrypoints import chat_media

    base, _ = http_media

    def chat(name):
        part = {"type": "image_url", "image_url": {"url": f"{base}/{name}"}}
        messages = [{"role": "user", "content": [part, {"type": "text", "text": QUESTION}]}]
        return llm.chat(messages, GREEDY)[0].outputs[0].token_ids

    assert chat("a.png") == expected[0]
    monkeypatch.setattr(chat_media, "MAX_IMAGE_BYTES", 4096)
    for name, words in (("big.png", "larger than"), ("missing.png", "HTTP 404")):
        with pytest.raises(InvalidRequestError, match=words) as info:
            chat(name)
        assert info.value.param == "messages[0].content[0]"


def test_allowed_media_domains_limit_the_hosts_and_their_redirects(http_media, images):
    """``--allowed-media-domains``: a URL whose host is listed is fetched; another host, or a
    listed one redirecting to another, is a 400 naming the part, before anything is read."""
    from pyxllm.entrypoints.chat_media import load_image_url
    from pyxllm.multimodal_inputs import MediaPolicy

    base, _ = http_media
    port = base.rsplit(":", 1)[1]
    where = "messages[0].content[0]"
    local = MediaPolicy(allowed_media_domains=("127.0.0.1",))
    assert load_image_url(f"{base}/a.png", where, local).size == images[0].size
    other = MediaPolicy(allowed_media_domains=("example.com",))
    with pytest.raises(InvalidRequestError, match="allowed-media-domains") as info:
        load_image_url(f"{base}/a.png", where, other)
    assert info.value.param == where
    with pytest.raises(InvalidRequestError, match="not 'localhost'"):
        load_image_url(f"http://localhost:{port}/a.png", where, local)
    # a listed host redirecting to another: refused at the redirect
    import http.server
    import threading

    class Redirect(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            self.send_response(302)
            self.send_header("Location", f"http://localhost:{port}/a.png")
            self.end_headers()

        def log_message(self, *args):
            pass

    redirector = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Redirect)
    threading.Thread(target=redirector.serve_forever, daemon=True).start()
    try:
        hop = f"http://127.0.0.1:{redirector.server_address[1]}/a.png"
        with pytest.raises(InvalidRequestError, match="not 'localhost'"):
            load_image_url(hop, where, local)
        # with any host allowed, the redirect is followed
        assert load_image_url(hop, where, MediaPolicy()).size == images[0].size
    finally:
        redirector.shutdown()
        redirector.server_close()


def test_an_image_of_too_many_pixels_is_refused_before_decoding(llm, images, monkeypatch):
    from pyxllm.entrypoints import chat_media

    monkeypatch.setattr(chat_media, "MAX_IMAGE_PIXELS", 40 * 60 - 1)  # images[0] is 40x60
    with pytest.raises(InvalidRequestError, match="40x60 pixels") as info:
        llm.chat(image_chat(images[0]), GREEDY)
    assert info.value.param == "messages[0].content[0]"


def test_too_many_images_a_count_mismatch_and_no_fetching(llava, images):
    llm = LLM(
        str(llava[0]),
        max_model_len=256,
        kv_cache_memory=64 * BLOCK_GIB,
        limit_mm_per_prompt="image=1",
        fetch_media=False,
    )
    fetched = [{"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/a.png"}}]
    with pytest.raises(InvalidRequestError, match="no-fetch-media") as info:
        llm.chat([{"role": "user", "content": fetched}], GREEDY)
    assert info.value.param == "messages[0].content[0]"
    two = [
        {
            "role": "user",
            "content": [
                {"type": "image_pil", "image_pil": images[0]},
                {"type": "image_pil", "image_pil": images[1]},
            ],
        }
    ]
    with pytest.raises(InvalidRequestError, match="more than 1 image in one prompt") as info:
        llm.chat(two, GREEDY)
    assert info.value.param == "messages[0].content[1]"
    with pytest.raises(InvalidRequestError, match="image placeholders"):
        llm.generate(
            {"prompt": "USER: no image\nASSISTANT:", "multi_modal_data": {"image": images[0]}}
        )


@pytest.fixture(scope="module")
def server(llava, tmp_path_factory):
    """A server on the tiny LLaVA: at most 2 images a prompt, file:// URLs under a media
    directory (the fixture's second item)."""
    media = tmp_path_factory.mktemp("media")
    args = [
        str(llava[0]),
        "--max-model-len",
        "256",
        "--kv-cache-memory",
        str(64 * BLOCK_GIB),
        "--limit-mm-per-prompt",
        "image=2",
        "--allowed-local-media-path",
        str(media),
    ]
    with RemoteServer(args) as remote:
        yield remote, media


def test_server_answers_a_base64_image_through_the_openai_sdk(server, llava, images, expected):
    remote, media = server
    client = remote.openai_client()
    tokenizer = llava[2].tokenizer
    path = media / "cat.png"
    images[1].save(path)
    num_text_tokens = len(tokenizer.encode(CHAT_TEXT, add_special_tokens=False)) - 1
    for url, want in ((data_url(images[0]), expected[0]), (path.as_uri(), expected[1])):
        reply = client.chat.completions.create(
            model=client.models.list().data[0].id,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": url}},
                        {"type": "text", "text": QUESTION},
                    ],
                }
            ],
            max_tokens=MAX_TOKENS,
            temperature=0,
        )
        assert reply.choices[0].message.content == tokenizer.decode(want, skip_special_tokens=True)
        # the <image> token became the image's placeholder run, which /tokenize counts too
        assert reply.usage.prompt_tokens == num_text_tokens + NUM_IMAGE_TOKENS
        counted = httpx.post(
            remote.url_for("tokenize"),
            json={
                "model": reply.model,
                "messages": [
                    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}
                ],
            },
            timeout=60,
        )
        assert (
            counted.json()["count"]
            == len(tokenizer.encode(f"USER: {IMAGE_TOKEN}\nASSISTANT:", add_special_tokens=False))
            - 1
            + NUM_IMAGE_TOKENS
        )


@pytest.mark.parametrize(
    ("parts", "where", "words"),
    [
        (
            [{"type": "image_url", "image_url": {"url": "data:image/png;base64,aGVsbG8="}}],
            0,
            "image",
        ),
        ([{"type": "image_url", "image_url": {"url": "gopher://x/y.png"}}], 0, "scheme"),
        ([{"type": "image_url", "image_url": {"url": "file:///etc/hostname"}}], 0, "allowed"),
        ([{"type": "image_url", "image_url": {"url": DATA_URL_OF_SEED_0}}] * 3, 2, "limit-mm"),
    ],
)
def test_server_refuses_bad_images_by_part_and_serves_on(server, parts, where, words):
    remote, _ = server
    body = {
        "model": "x",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, *parts]}],
        "max_tokens": 2,
    }
    body["model"] = httpx.get(remote.url_for("v1", "models")).json()["data"][0]["id"]
    response = httpx.post(remote.url_for("v1", "chat", "completions"), json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == f"messages[0].content[{where + 1}]"
    assert words in error["message"]
    ok = httpx.post(
        remote.url_for("v1", "chat", "completions"),
        json={**body, "messages": [{"role": "user", "content": "hi"}]},
        timeout=60,
    )
    assert ok.status_code == 200, ok.text


def test_responses_api_takes_an_input_image(server, llava, images, expected):
    remote, _ = server
    model = httpx.get(remote.url_for("v1", "models")).json()["data"][0]["id"]

    def respond(url):
        content = [
            {"type": "input_image", "image_url": url},
            {"type": "input_text", "text": QUESTION},
        ]
        body = {
            "model": model,
            "input": [{"role": "user", "content": content}],
            "max_output_tokens": MAX_TOKENS,
            "temperature": 0,
        }
        return httpx.post(remote.url_for("v1", "responses"), json=body, timeout=60)

    reply = respond(data_url(images[0]))
    assert reply.status_code == 200, reply.text
    text = reply.json()["output"][-1]["content"][0]["text"]
    assert text == llava[2].tokenizer.decode(expected[0], skip_special_tokens=True)
    bad = respond("data:image/png;base64,aGk=")
    assert bad.status_code == 400
    assert bad.json()["error"]["param"] == "input[0].content[0]"


def test_anthropic_messages_take_image_blocks(server, llava, images, expected):
    """Anthropic's ``image`` blocks (a base64 source) are the chat API's image parts: the same
    greedy text; a Files API source is a 400 naming the block."""
    remote, _ = server
    model = httpx.get(remote.url_for("v1", "models")).json()["data"][0]["id"]
    data = data_url(images[0]).split(",", 1)[1]

    def message(source):
        content = [
            {"type": "image", "source": source},
            {"type": "text", "text": QUESTION},
        ]
        body = {
            "model": model,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "messages": [{"role": "user", "content": content}],
        }
        return httpx.post(remote.url_for("v1", "messages"), json=body, timeout=60)

    reply = message({"type": "base64", "media_type": "image/png", "data": data})
    assert reply.status_code == 200, reply.text
    text = reply.json()["content"][0]["text"]
    assert text == llava[2].tokenizer.decode(expected[0], skip_special_tokens=True)
    bad = message({"type": "file", "file_id": "file_1"})
    assert bad.status_code == 400
    assert "messages[0].content[0].source.type" in bad.json()["error"]["message"]


def test_a_file_url_names_what_is_wrong_with_it(tmp_path):
    """A missing file under --allowed-local-media-path is missing, not outside it."""
    from pyxllm.entrypoints.chat_media import _read_local

    (tmp_path / "media").mkdir()
    (tmp_path / "media" / "a.png").write_bytes(b"png")
    (tmp_path / "outside.png").write_bytes(b"png")
    allowed = str(tmp_path / "media")
    assert _read_local(f"file://{tmp_path}/media/a.png", "w", allowed) == b"png"
    with pytest.raises(InvalidRequestError, match=r"media/nope.png: no such file$"):
        _read_local(f"file://{tmp_path}/media/nope.png", "w", allowed)
    with pytest.raises(InvalidRequestError, match="outside.png is not under --allowed-local"):
        _read_local(f"file://{tmp_path}/outside.png", "w", allowed)
