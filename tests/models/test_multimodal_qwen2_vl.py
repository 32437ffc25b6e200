"""Qwen2.5-VL, Qwen2-VL and Qwen3-VL end to end on tiny random checkpoints: mRoPE positions
equal transformers' ``get_rope_index`` for any slice of a prompt, and greedy tokens equal
transformers' float32 ``generate`` on text+image prompts, with the prefix cache and chunked
prefill on (hits and chunks that end inside an image), batched with text-only requests."""

from __future__ import annotations

import pytest
import torch

from pyxllm import LLM, SamplingParams
from pyxllm.engine.input_processor import TextPrompt
from pyxllm.multimodal_inputs import mrope_positions
from tests.llava_fixtures import data_url, make_image, record_partial_runs
from tests.qwen2_vl_fixtures import (
    IMAGE,
    IMAGE_TOKEN,
    build_qwen2_vl,
    reference_inputs,
    reference_tokens,
)

pytestmark = pytest.mark.usefixtures("one_thread")

MAX_TOKENS = 6
QUESTION = "What is in the picture?"
# a question short enough that a prompt with a 16-token image fits in 2 blocks, so that a
# prefix-cache hit (its first block) ends inside the image
SHORT = "What?"


def chat_text(question: str = QUESTION) -> str:
    """What the chat template renders for one image then ``question``."""
    return f"<|im_start|>user\n{IMAGE}{question}<|im_end|>\n<|im_start|>assistant\n"


CHAT_TEXT = chat_text()
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
# the KV bytes of one 16-token block of the tiny model: 2 (K, V) x 2 layers x 16 x 2 heads x 16
BLOCK_GIB = 2 * 2 * 16 * 2 * 16 * 4 / 2**30
# tokens a step: prompts of ~25-40 tokens are prefilled in chunks that end inside image runs
STEP_TOKENS = 7


@pytest.fixture(scope="module")
def qwen(tmp_path_factory, hf_gguf_tokenizer):
    """``(directory, hf_model, image_processor, tokenizer)`` of the tiny Qwen2.5-VL."""
    return build_qwen2_vl(tmp_path_factory.mktemp("qwen2_5_vl"), hf_gguf_tokenizer)


@pytest.fixture(scope="module")
def llm(qwen):
    """One engine for the module: prefix cache on, chunked prefill in steps of STEP_TOKENS."""
    return LLM(
        str(qwen[0]),
        max_model_len=512,
        kv_cache_memory=96 * BLOCK_GIB,
        max_tokens_per_batch=STEP_TOKENS,
        enable_chunked_prefill=True,
    )


def image_chat(image, question: str = QUESTION) -> list[dict]:
    part = {"type": "image_url", "image_url": {"url": data_url(image)}}
    return [{"role": "user", "content": [part, {"type": "text", "text": question}]}]


def test_mrope_positions_equal_transformers_for_every_slice(llm, qwen):
    images = [make_image(0, (60, 40)), make_image(1, (100, 30))]  # grids 2 x 3 and 1 x 4
    text = f"<|im_start|>user\n{IMAGE}and{IMAGE}differ?<|im_end|>\n"
    inputs = reference_inputs(qwen, text, images)
    model = qwen[1].model
    want, deltas = model.get_rope_index(
        inputs["input_ids"],
        inputs["mm_token_type_ids"],
        image_grid_thw=inputs["image_grid_thw"],
    )
    want, delta = want[:, 0], int(deltas[0, 0])
    prompt = llm.llm_engine.input_processor.process(
        "r", TextPrompt(text, multi_modal_data={"image": images})
    )
    features = prompt.mm_features
    assert [f.mrope_grid for f in features] == [(1, 2, 3), (1, 1, 4)]
    length = want.shape[1]
    assert prompt.prompt_token_ids == inputs["input_ids"][0].tolist()
    for start in range(length):
        for end in range(start + 1, length + 1):
            assert torch.equal(mrope_positions(features, start, end), want[:, start:end])
    # generated tokens: their index plus transformers' rope_deltas, in every component
    after = mrope_positions(features, length, length + 3)
    assert torch.equal(after, torch.arange(length, length + 3).expand(3, -1) + delta)
    assert delta < 0  # the images shift the text after them (else this proves little)


def test_chat_with_an_image_equals_transformers(llm, qwen):
    tok = qwen[3]
    # grids of 2 x 3 and 1 x 4 merged tokens
    square, wide = make_image(0, (60, 40)), make_image(1, (100, 30))
    for image in (square, wide):
        out = llm.chat(image_chat(image), GREEDY)[0]
        assert out.outputs[0].token_ids == reference_tokens(qwen, CHAT_TEXT, [image], MAX_TOKENS)
        # the prompt is the processor's expansion: one <|image_pad|> per merged square
        want = reference_inputs(qwen, CHAT_TEXT, [image])["input_ids"][0].tolist()
        assert out.prompt_token_ids == want
    assert out.prompt_token_ids.count(tok.convert_tokens_to_ids(IMAGE_TOKEN)) == 4
    # the image moves the tokens (else these tests prove nothing)
    assert reference_tokens(qwen, CHAT_TEXT, [square], MAX_TOKENS) != reference_tokens(
        qwen, CHAT_TEXT, [wide], MAX_TOKENS
    )


# a chat template that writes a message's content as one string (no loop over content parts)
STRING_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_string_content_gets_the_vision_tokens_around_each_image(llm, qwen, monkeypatch):
    """With a template that does not loop over content parts, an image is written as Qwen's
    own templates write it (vLLM's placeholder string), ``<|vision_start|>`` and
    ``<|vision_end|>`` around the image token, and the tokens equal transformers' for that
    text."""
    image = make_image(0, (60, 40))
    monkeypatch.setattr(llm.get_tokenizer().hf, "chat_template", STRING_TEMPLATE)
    out = llm.chat(image_chat(image), GREEDY)[0]
    text = f"<|im_start|>user\n{IMAGE}\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n"
    assert out.prompt_token_ids == reference_inputs(qwen, text, [image])["input_ids"][0].tolist()
    assert out.outputs[0].token_ids == reference_tokens(qwen, text, [image], MAX_TOKENS)


def test_two_images_in_one_prompt(llm, qwen):
    images = [make_image(2, (48, 64)), make_image(3, (112, 112))]
    text = f"<|im_start|>user\n{IMAGE}and{IMAGE}Which differ?<|im_end|>\n<|im_start|>assistant\n"
    out = llm.generate({"prompt": text, "multi_modal_data": {"image": images}}, GREEDY)[0]
    assert out.outputs[0].token_ids == reference_tokens(qwen, text, images, MAX_TOKENS)


def test_batched_with_text_requests(llm, qwen):
    texts = [
        "<|im_start|>user\nTell me a story.<|im_end|>\n<|im_start|>assistant\n",
        "<|im_start|>user\nCount to five.<|im_end|>\n<|im_start|>assistant\n",
    ]
    images = [make_image(4), make_image(5, (64, 40))]
    cases = [(texts[0], []), (CHAT_TEXT, images[:1]), (texts[1], []), (CHAT_TEXT, images[1:])]
    requests = [
        {"prompt": text, "multi_modal_data": {"image": imgs}} if imgs else text
        for text, imgs in cases
    ]
    outs = llm.generate(requests, GREEDY)
    want = [reference_tokens(qwen, text, imgs, MAX_TOKENS) for text, imgs in cases]
    assert [o.outputs[0].token_ids for o in outs] == want


def test_prefix_cache_hits_the_same_image_and_misses_another(llm, qwen):
    encoder = llm.llm_engine.executor.driver.encoder_cache
    # 16 tokens each, from the prompt's 5th: the hit (the first block) ends inside the image
    images = [make_image(6, (112, 112)), make_image(7, (112, 112))]
    encoded = encoder.num_encoded
    first = llm.chat(image_chat(images[0], SHORT), GREEDY)[0]
    again = llm.chat(image_chat(images[0], SHORT), GREEDY)[0]
    other = llm.chat(image_chat(images[1], SHORT), GREEDY)[0]
    want = [reference_tokens(qwen, chat_text(SHORT), [img], MAX_TOKENS) for img in images]
    assert [o.outputs[0].token_ids for o in (first, again, other)] == [want[0], want[0], want[1]]
    assert first.num_cached_tokens == 0
    image_run = first.prompt_token_ids.index(qwen[1].config.image_token_id)
    assert image_run < again.num_cached_tokens == 16 < image_run + 16
    # the same tokens with another image: the first block holds its run, so no hit
    assert other.prompt_token_ids == first.prompt_token_ids
    assert other.num_cached_tokens == 0
    assert encoder.num_encoded - encoded == 2  # the first image encoded once


def test_chunked_prefill_cuts_through_the_image(llm, qwen, monkeypatch):
    cuts = record_partial_runs(llm.llm_engine.executor.driver.encoder_cache, monkeypatch)
    image = make_image(8, (84, 84))
    out = llm.chat(image_chat(image), GREEDY)[0]
    assert out.outputs[0].token_ids == reference_tokens(qwen, CHAT_TEXT, [image], MAX_TOKENS)
    assert cuts  # some step ended inside the image's run, its rows sliced


def test_preemption_recomputes_the_image_and_its_positions(qwen):
    # 4 blocks: three prompts of ~2 blocks each and their outputs cannot all run, so some are
    # recomputed from position 0, their generated tokens too (after the images' shift)
    llm = LLM(
        str(qwen[0]),
        max_model_len=256,
        kv_cache_memory=4 * BLOCK_GIB,
        enable_prefix_cache=False,
    )
    llm.llm_engine.executor.driver.encoder_cache.max_rows = 0  # recompute the encoder too
    images = [make_image(12, (112, 112)), make_image(13, (84, 112)), make_image(14, (112, 84))]
    outs = llm.chat(
        [image_chat(img) for img in images], SamplingParams(max_tokens=12, temperature=0)
    )
    want = [reference_tokens(qwen, CHAT_TEXT, [img], 12) for img in images]
    assert [o.outputs[0].token_ids for o in outs] == want
    assert llm.llm_engine.scheduler.num_preemptions > 0


def test_qwen2_vl_equals_transformers(tmp_path, hf_gguf_tokenizer):
    qwen2 = build_qwen2_vl(tmp_path, hf_gguf_tokenizer, version="2")
    llm = LLM(
        str(qwen2[0]),
        max_model_len=256,
        kv_cache_memory=32 * BLOCK_GIB,
        max_tokens_per_batch=STEP_TOKENS,
        enable_chunked_prefill=True,
    )
    images = [make_image(9, (60, 40)), make_image(10, (56, 84))]
    outs = llm.chat([image_chat(img) for img in images], GREEDY)
    want = [reference_tokens(qwen2, CHAT_TEXT, [img], MAX_TOKENS) for img in images]
    assert [o.outputs[0].token_ids for o in outs] == want


def test_qwen3_vl_with_deepstack_equals_transformers(tmp_path, hf_gguf_tokenizer):
    """Qwen3-VL: interleaved mRoPE and deepstack features added after the first layers, through
    chunks that cut the images and a prefix-cache hit that ends inside one."""
    qwen3 = build_qwen2_vl(tmp_path, hf_gguf_tokenizer, version="3")
    llm = LLM(
        str(qwen3[0]),
        max_model_len=256,
        kv_cache_memory=48 * BLOCK_GIB,
        max_tokens_per_batch=STEP_TOKENS,
        enable_chunked_prefill=True,
    )
    # 32-pixel squares: grids of 2 x 4, 2 x 2 and 4 x 4 merged tokens
    images = [make_image(15, (128, 64)), make_image(16, (60, 40)), make_image(17, (128, 128))]
    outs = llm.chat([image_chat(img) for img in images], GREEDY)
    want = [reference_tokens(qwen3, CHAT_TEXT, [img], MAX_TOKENS) for img in images]
    assert [o.outputs[0].token_ids for o in outs] == want
    first = llm.chat(image_chat(images[2], SHORT), GREEDY)[0]
    again = llm.chat(image_chat(images[2], SHORT), GREEDY)[0]
    want = reference_tokens(qwen3, chat_text(SHORT), images[2:], MAX_TOKENS)
    assert first.outputs[0].token_ids == again.outputs[0].token_ids == want
    image_run = first.prompt_token_ids.index(qwen3[1].config.image_token_id)
    assert image_run < again.num_cached_tokens == 16 < image_run + 16  # a hit inside the image


def test_server_answers_a_base64_image_through_the_openai_sdk(qwen):
    """The chat route (in process: the app on its own engine) with a template that loops over
    content parts, through the openai SDK."""
    import openai
    from fastapi.testclient import TestClient

    from pyxllm.engine.async_engine import AsyncEngine
    from pyxllm.entrypoints.openai.api_server import build_app
    from pyxllm.entrypoints.openai.server_options import ServerOptions

    image = make_image(11, (60, 40))
    llm = LLM(str(qwen[0]), max_model_len=256, kv_cache_memory=32 * BLOCK_GIB)
    engine = AsyncEngine(llm.llm_engine)
    try:
        with TestClient(build_app(engine, ServerOptions())) as http:
            client = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http)
            reply = client.chat.completions.create(
                model=client.models.list().data[0].id,
                messages=image_chat(image),
                max_tokens=MAX_TOKENS,
                temperature=0,
            )
    finally:
        engine.shutdown()
    want = reference_tokens(qwen, CHAT_TEXT, [image], MAX_TOKENS)
    assert reply.choices[0].message.content == qwen[3].decode(want, skip_special_tokens=True)
    prompt = reference_inputs(qwen, CHAT_TEXT, [image])["input_ids"]
    assert reply.usage.prompt_tokens == prompt.shape[1]
