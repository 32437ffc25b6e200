"""Gemma 3 with images (``Gemma3ForConditionalGeneration``) end to end on a tiny random
checkpoint: greedy tokens equal transformers' float32 ``generate``, with the prefix cache and
chunked prefill on; the image tokens attend bidirectionally within their image, so no prefill
chunk ends inside an image (a prefix-cache hit may, and the image's rest then comes whole)."""

from __future__ import annotations

import pytest
import torch

from pyxllm import LLM, SamplingParams
from pyxllm.config import EngineConfig
from pyxllm.engine.kv_cache_manager import KVCacheManager
from pyxllm.engine.request import Request, RequestStatus
from pyxllm.engine.scheduler import Scheduler
from pyxllm.kernels.cpu.features import cpu_flags
from pyxllm.multimodal_inputs import MultiModalFeatureSpec, PlaceholderRange
from tests.gemma3_fixtures import BOI, MM_TOKENS_PER_IMAGE, build_gemma3
from tests.llava_fixtures import data_url, make_image, record_partial_runs, reference_tokens
from tests.utils import RemoteServer

pytestmark = pytest.mark.usefixtures("one_thread")

MAX_TOKENS = 6
QUESTION = "What is in the picture?"
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
# the KV bytes of one 16-token block of the tiny model: 2 (K, V) x 4 layers x 16 x 2 heads x 32
BLOCK_GIB = 2 * 4 * 16 * 2 * 32 * 4 / 2**30
# tokens a step: below an image's 16 soft tokens, so a chunk would cut every image; the image
# alone exceeds it, so it runs whole, over the budget
STEP_TOKENS = 12


def chat_text(question: str = QUESTION, images: int = 1) -> str:
    """What the chat template renders for ``images`` images then ``question``."""
    return (
        f"<|im_start|><start_of_turn>user\n{BOI * images}{question}<end_of_turn>\n"
        "<start_of_turn>model\n"
    )


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory, hf_gguf_tokenizer):
    """``(directory, hf_model, processor)`` of the tiny Gemma 3."""
    return build_gemma3(tmp_path_factory.mktemp("gemma3"), hf_gguf_tokenizer)


@pytest.fixture(scope="module", params=[True, False], ids=["batch_invariant", "prefill_kernel"])
def llm(request, gemma3):
    """An engine with the prefix cache on and chunked prefill in steps of STEP_TOKENS: with
    ``--batch-invariant`` (the default: every token a row of the decode kernel), then without
    (prefill chunks through the prefill kernel)."""
    return LLM(
        str(gemma3[0]),
        max_model_len=256,
        kv_cache_memory=64 * BLOCK_GIB,
        max_tokens_per_batch=STEP_TOKENS,
        enable_chunked_prefill=True,
        batch_invariant=request.param,
    )


def image_chat(image, question: str = QUESTION) -> list[dict]:
    part = {"type": "image_url", "image_url": {"url": data_url(image)}}
    return [{"role": "user", "content": [part, {"type": "text", "text": question}]}]


def expect(gemma3, text: str, images) -> list[int]:
    return reference_tokens(gemma3[1], gemma3[2], text, images, MAX_TOKENS)


def record_step_sizes(llm, monkeypatch) -> list[int]:
    """A list each planned step's token count is appended to."""
    sizes, scheduler = [], llm.llm_engine.scheduler
    schedule = scheduler.schedule

    def recording():
        plan = schedule()
        sizes.append(plan.num_tokens)
        return plan

    monkeypatch.setattr(scheduler, "schedule", recording)
    return sizes


def test_chat_with_an_image_equals_transformers(llm, gemma3, monkeypatch):
    processor = gemma3[2]
    cuts = record_partial_runs(llm.llm_engine.executor.driver.encoder_cache, monkeypatch)
    sizes = record_step_sizes(llm, monkeypatch)
    images = [make_image(0), make_image(1, (64, 48))]
    outs = [llm.chat(image_chat(image), GREEDY)[0] for image in images]
    # the first chunk stops before the image (5 tokens), which runs whole, over the budget
    assert sizes[:2] == [5, MM_TOKENS_PER_IMAGE] and STEP_TOKENS < MM_TOKENS_PER_IMAGE
    want = [expect(gemma3, chat_text(), [image]) for image in images]
    assert [o.outputs[0].token_ids for o in outs] == want
    assert want[0] != want[1]  # the image moves the tokens (else these tests prove nothing)
    # the prompt is transformers' expansion, its newlines joined with the text around the image
    ids = processor(images=images[:1], text=chat_text(), return_tensors="pt")["input_ids"]
    assert outs[0].prompt_token_ids == ids[0].tolist()
    assert ids[0].tolist().count(processor.tokenizer.image_token_id) == MM_TOKENS_PER_IMAGE
    assert not cuts  # no step ended inside an image, whose 16 tokens exceed a step's 12


def test_two_images_in_one_prompt(llm, gemma3):
    images = [make_image(2, (48, 64)), make_image(3)]
    text = chat_text("Which differ?", images=2)
    out = llm.generate({"prompt": text, "multi_modal_data": {"image": images}}, GREEDY)[0]
    assert out.outputs[0].token_ids == expect(gemma3, text, images)


def test_batched_with_text_requests(llm, gemma3):
    stories = chat_text("Tell me a story.", images=0), chat_text("Count to five.", images=0)
    images = [make_image(4), make_image(5, (64, 40))]
    cases = [
        (stories[0], []),
        (chat_text(), images[:1]),
        (stories[1], []),
        (chat_text(), images[1:]),
    ]
    requests = [
        {"prompt": text, "multi_modal_data": {"image": imgs}} if imgs else text
        for text, imgs in cases
    ]
    outs = llm.generate(requests, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == [expect(gemma3, t, i) for t, i in cases]


def test_prefix_cache_hits_the_same_image_and_misses_another(llm, gemma3):
    images = [make_image(6), make_image(7)]  # not used by the other tests
    first = llm.chat(image_chat(images[0]), GREEDY)[0]
    again = llm.chat(image_chat(images[0]), GREEDY)[0]
    other = llm.chat(image_chat(images[1]), GREEDY)[0]
    want = [expect(gemma3, chat_text(), [img]) for img in images]
    assert [o.outputs[0].token_ids for o in (first, again, other)] == [want[0], want[0], want[1]]
    assert first.num_cached_tokens == 0
    assert again.num_cached_tokens == (len(again.prompt_token_ids) - 1) // 16 * 16 > 0
    assert other.prompt_token_ids == first.prompt_token_ids
    assert other.num_cached_tokens == 0  # the first block holds the image's first tokens


def test_a_prefix_hit_ending_inside_the_image_computes_its_rest_whole(llm, gemma3, monkeypatch):
    image, processor = make_image(8), gemma3[2]
    llm.chat(image_chat(image, "Describe it."), GREEDY)
    ids = processor(images=[image], text=chat_text("Describe it."))["input_ids"][0]
    offset = ids.index(processor.tokenizer.image_token_id)
    end = offset + MM_TOKENS_PER_IMAGE
    assert offset < 16 < end  # the first block ends inside the image
    cuts = record_partial_runs(llm.llm_engine.executor.driver.encoder_cache, monkeypatch)
    out = llm.chat(image_chat(image, "And the colours?"), GREEDY)[0]
    assert out.num_cached_tokens == 16
    assert out.outputs[0].token_ids == expect(gemma3, chat_text("And the colours?"), [image])
    assert cuts == [(16, end)]  # the image's rest in one step, after the hit


def test_a_rest_that_fits_a_step_but_not_the_budget_left_waits():
    # the scheduler alone, 16 tokens a step: a text request decodes (1 token a step) beside a
    # request whose 16-token image starts at 3; its chunks stop before the image, which then
    # waits while the step has 15 tokens left, and runs whole once the text request is done
    config = EngineConfig(block_size=4, max_tokens_per_batch=16, max_seqs_per_batch=4)
    scheduler = Scheduler(config, KVCacheManager(64, 4), bidirectional_images=True)
    params = SamplingParams(temperature=0, max_tokens=8)
    text = Request("t", None, [7] * 14, params, detokenizer=None)
    feature = MultiModalFeatureSpec("image", "h", PlaceholderRange(3, MM_TOKENS_PER_IMAGE), {})
    image = Request("i", None, [9] * 24, params, detokenizer=None, mm_features=(feature,))
    wanted = {"t": 4, "i": 2}  # outputs each request runs to
    scheduler.add_request(text)
    scheduler.add_request(image)
    steps = []
    while scheduler.has_unfinished_requests():
        plan = scheduler.schedule()
        steps.append(
            [(s.request_id, len(s.token_ids), s.bidirectional_ranges) for s in plan.sequences]
        )
        sampled = [[5] if s.sample else [] for s in plan.sequences]
        for request, _ in scheduler.update_from_output(sampled):
            if request.num_output_tokens >= wanted[request.request_id]:
                scheduler.finish_request(request, RequestStatus.FINISHED_LENGTH)
    assert steps == [
        [("t", 14, ()), ("i", 2, ())],
        [("t", 1, ()), ("i", 1, ())],  # stops before the image
        [("t", 1, ())],  # the image's 16 tokens wait: 15 left
        [("t", 1, ())],
        [("i", 16, ((3, 19),))],
        [("i", 5, ())],
        [("i", 1, ())],
    ]


def first_token_logprob(llm, image) -> float:
    params = SamplingParams(max_tokens=1, temperature=0, logprobs=0)
    out = llm.chat(image_chat(image), params)[0].outputs[0]
    return out.logprobs[0][out.token_ids[0]].logprob


def test_image_tokens_see_their_whole_image(llm, gemma3, monkeypatch):
    # transformers' log-probability of the first greedy token; the engine's, and with the
    # image attended causally (no key limits) another one
    image = make_image(9)  # not used by the other tests: no prefix-cache hit
    inputs = gemma3[2](images=[image], text=chat_text(), return_tensors="pt")
    with torch.no_grad():
        logits = gemma3[1](**inputs).logits[0, -1]
    want = float(torch.log_softmax(logits, -1).max())
    assert first_token_logprob(llm, image) == pytest.approx(want, abs=1e-4)
    monkeypatch.setattr(llm.llm_engine.scheduler, "bidirectional_images", False)
    llm.llm_engine.kv_cache_manager.reset_prefix_cache()  # no hit on the blocks just computed
    causal = first_token_logprob(llm, image)
    assert abs(causal - want) > 1e-3


def greedy_bits(out) -> tuple[list[int], list[list[tuple[int, float]]]]:
    """A request's greedy tokens and the log-probabilities given with them, to compare bit
    for bit (float equality)."""
    o = out.outputs[0]
    return o.token_ids, [sorted((t, p.logprob) for t, p in d.items()) for d in o.logprobs]


# the defaults (--dtype auto: this float32 checkpoint's float32), and bfloat16 where the CPU
# computes in it
DTYPES = ["auto", *(["bfloat16"] if "avx512_bf16" in cpu_flags() else [])]


@pytest.mark.parametrize("dtype", DTYPES)
def test_an_image_requests_bits_do_not_depend_on_its_neighbours(gemma3, dtype, monkeypatch):
    """Default settings (``--batch-invariant``): the image's prompt tokens attend through the
    fused decode kernel up to their key limits, one row each over its own keys, so the request
    gets the same tokens and log-probabilities, bit for bit, alone on a fresh engine, in one
    step beside a longer text request, and after a prefix-cache hit."""
    llm = LLM(str(gemma3[0]), max_model_len=256, kv_cache_memory=64 * BLOCK_GIB, dtype=dtype)
    try:
        image = make_image(14)  # the engine's own: not used by the other tests
        request = {"prompt": chat_text(), "multi_modal_data": {"image": [image]}}
        story = chat_text("Tell me a long story about a dragon, " * 8, images=0)
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, logprobs=2)
        alone = llm.generate(request, params)[0]
        llm.llm_engine.kv_cache_manager.reset_prefix_cache()
        sizes = record_step_sizes(llm, monkeypatch)
        text, batched = llm.generate([story, request], params)
        hit = llm.generate(request, params)[0]
        # both prompts in the first step, the text's context the longer
        assert sizes[0] == len(text.prompt_token_ids) + len(batched.prompt_token_ids)
        assert len(text.prompt_token_ids) > 2 * len(batched.prompt_token_ids)
        assert alone.num_cached_tokens == batched.num_cached_tokens == 0
        assert hit.num_cached_tokens > 0
        assert greedy_bits(batched) == greedy_bits(alone)
        assert greedy_bits(hit) == greedy_bits(alone)
        if dtype == "auto":
            assert alone.outputs[0].token_ids == expect(gemma3, chat_text(), [image])
    finally:
        llm.llm_engine.shutdown()


@pytest.fixture(scope="module")
def server(gemma3):
    """A server on the tiny Gemma 3 (nothing else shares it)."""
    args = [str(gemma3[0]), "--max-model-len", "256", "--kv-cache-memory", str(64 * BLOCK_GIB)]
    with RemoteServer(args) as remote:
        yield remote


def test_server_answers_a_base64_image_through_the_openai_sdk(server, gemma3):
    client = server.openai_client()
    image, tokenizer = make_image(10), gemma3[2].tokenizer
    reply = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=image_chat(image),
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    want = expect(gemma3, chat_text(), [image])
    assert reply.choices[0].message.content == tokenizer.decode(want, skip_special_tokens=True)


def test_two_tensor_parallel_ranks_give_transformers_tokens(gemma3):
    """``--tensor-parallel-size 2``: the step plan carries each step's bidirectional images to
    rank 1, whose attention lets their tokens see their whole image too."""
    llm = LLM(
        str(gemma3[0]),
        max_model_len=256,
        kv_cache_memory=64 * BLOCK_GIB,
        max_tokens_per_batch=STEP_TOKENS,
        enable_chunked_prefill=True,
        tensor_parallel_size=2,
    )
    try:
        images = [make_image(11), make_image(12, (64, 40))]
        outs = llm.chat([image_chat(image) for image in images], GREEDY)
        want = [expect(gemma3, chat_text(), [image]) for image in images]
        assert [o.outputs[0].token_ids for o in outs] == want
    finally:
        llm.llm_engine.shutdown()


def test_pil_images_and_pan_and_scan_off(llm, gemma3, monkeypatch):
    # LLM.chat with a PIL image; a processor config that turns pan-and-scan on changes nothing,
    # as Gemma3Processor passes it off to the image processor (its images_kwargs)
    image = make_image(13, (96, 32))
    part = {"type": "image_pil", "image_pil": image}
    chat = [{"role": "user", "content": [part, {"type": "text", "text": QUESTION}]}]
    want = expect(gemma3, chat_text(), [image])
    assert llm.chat(chat, GREEDY)[0].outputs[0].token_ids == want
    processor = llm.llm_engine.input_processor.multimodal.image_processor
    monkeypatch.setattr(processor, "do_pan_and_scan", True)
    monkeypatch.setattr(processor, "pan_and_scan_min_crop_size", 8)
    out = llm.chat(chat, GREEDY)[0]
    assert out.prompt_token_ids.count(gemma3[2].tokenizer.image_token_id) == MM_TOKENS_PER_IMAGE
    assert out.outputs[0].token_ids == want
