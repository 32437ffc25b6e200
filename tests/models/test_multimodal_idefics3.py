"""Idefics3 (SmolVLM) and SmolVLM2 (``SmolVLMForConditionalGeneration``, the same
architecture) end to end on tiny random checkpoints: each image split into crops by
transformers' image processor, greedy tokens equal to transformers' float32 ``generate``, with
the prefix cache and chunked prefill on, batched with text-only requests; crops padded as
transformers' processor pads them encoded as transformers encodes them."""

from __future__ import annotations

import pytest
import torch

from pyxllm import LLM, SamplingParams
from tests.idefics3_fixtures import IMAGE_SEQ_LEN, IMAGE_TOKEN, build_idefics3, build_smolvlm
from tests.llava_fixtures import data_url, make_image, record_partial_runs, reference_tokens

pytestmark = pytest.mark.usefixtures("one_thread")

MAX_TOKENS = 6
QUESTION = "What is in the picture?"
# what SmolVLM's chat template renders for one image then QUESTION
CHAT_TEXT = f"<|im_start|>User:{IMAGE_TOKEN}{QUESTION}<end_of_utterance>\nAssistant:"
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
# the KV bytes of one 16-token block of the tiny model: 2 (K, V) x 2 layers x 16 x 2 heads x 16
BLOCK_GIB = 2 * 2 * 16 * 2 * 16 * 4 / 2**30
# tokens a step: prompts of ~50 tokens are prefilled in chunks that end inside image runs
STEP_TOKENS = 7


@pytest.fixture(scope="module", params=[build_idefics3, build_smolvlm], ids=["idefics3", "smolvlm"])
def idefics3(request, tmp_path_factory, hf_gguf_tokenizer):
    """``(directory, hf_model, processor)`` of the tiny Idefics3, then of the tiny SmolVLM2
    (its processor: transformers' ``Idefics3Processor`` over SmolVLM's image processor)."""
    build = request.param
    return build(tmp_path_factory.mktemp(build.__name__), hf_gguf_tokenizer)


@pytest.fixture(scope="module")
def llm(idefics3):
    """One engine for the module: prefix cache on, chunked prefill in steps of STEP_TOKENS."""
    return LLM(
        str(idefics3[0]),
        max_model_len=512,
        kv_cache_memory=96 * BLOCK_GIB,
        max_tokens_per_batch=STEP_TOKENS,
        enable_chunked_prefill=True,
    )


def image_chat(image) -> list[dict]:
    part = {"type": "image_url", "image_url": {"url": data_url(image)}}
    return [{"role": "user", "content": [part, {"type": "text", "text": QUESTION}]}]


def expect(idefics3, text: str, images) -> list[int]:
    return reference_tokens(idefics3[1], idefics3[2], text, images, MAX_TOKENS)


def test_chat_with_an_image_equals_transformers(llm, idefics3):
    processor = idefics3[2]
    # 2 x 2 crops and the global image; a wide image: 1 x 2 crops and the global one
    square, wide = make_image(0), make_image(1, (200, 50))
    for image, crops in ((square, 5), (wide, 3)):
        out = llm.chat(image_chat(image), GREEDY)[0]
        assert out.outputs[0].token_ids == expect(idefics3, CHAT_TEXT, [image])
        # the prompt is transformers' expansion: row/column tags, one run per crop
        want = processor(images=[image], text=CHAT_TEXT, return_tensors="pt")["input_ids"]
        assert out.prompt_token_ids == want[0].tolist()
        assert out.prompt_token_ids.count(processor.image_token_id) == crops * IMAGE_SEQ_LEN
    # the image moves the tokens (else these tests prove nothing)
    assert expect(idefics3, CHAT_TEXT, [square]) != expect(idefics3, CHAT_TEXT, [wide])


def test_two_images_in_one_prompt(llm, idefics3):
    images = [make_image(2, (48, 64)), make_image(3)]
    text = f"<|im_start|>User:{IMAGE_TOKEN}{IMAGE_TOKEN}Which differ?<end_of_utterance>\nAssistant:"
    out = llm.generate({"prompt": text, "multi_modal_data": {"image": images}}, GREEDY)[0]
    assert out.outputs[0].token_ids == expect(idefics3, text, images)


def test_batched_with_text_requests(llm, idefics3):
    texts = [
        "<|im_start|>User: Tell me a story.<end_of_utterance>\nAssistant:",
        "<|im_start|>User: Count to five.<end_of_utterance>\nAssistant:",
    ]
    images = [make_image(4), make_image(5, (64, 40))]
    cases = [(texts[0], []), (CHAT_TEXT, images[:1]), (texts[1], []), (CHAT_TEXT, images[1:])]
    requests = [
        {"prompt": text, "multi_modal_data": {"image": imgs}} if imgs else text
        for text, imgs in cases
    ]
    outs = llm.generate(requests, GREEDY)
    want = [expect(idefics3, text, imgs) for text, imgs in cases]
    assert [o.outputs[0].token_ids for o in outs] == want


def test_prefix_cache_hits_the_same_image_and_misses_another(llm, idefics3):
    encoder = llm.llm_engine.executor.driver.encoder_cache
    images = [make_image(6), make_image(7)]  # not used by the other tests
    encoded = encoder.num_encoded
    first = llm.chat(image_chat(images[0]), GREEDY)[0]
    again = llm.chat(image_chat(images[0]), GREEDY)[0]
    other = llm.chat(image_chat(images[1]), GREEDY)[0]
    want = [expect(idefics3, CHAT_TEXT, [img]) for img in images]
    assert [o.outputs[0].token_ids for o in (first, again, other)] == [want[0], want[0], want[1]]
    assert first.num_cached_tokens == 0
    # the same image and text: every full block but the last token's is a hit
    assert again.num_cached_tokens == (len(again.prompt_token_ids) - 1) // 16 * 16 > 0
    # the same tokens with another image: the first block holds its crops' runs, so no hit
    assert other.prompt_token_ids == first.prompt_token_ids
    assert other.num_cached_tokens == 0
    assert encoder.num_encoded - encoded == 2 * 5  # 5 crops an image, the first encoded once


def test_chunked_prefill_cuts_through_the_image(llm, idefics3, monkeypatch):
    cuts = record_partial_runs(llm.llm_engine.executor.driver.encoder_cache, monkeypatch)
    image = make_image(8, (60, 60))
    out = llm.chat(image_chat(image), GREEDY)[0]
    assert out.outputs[0].token_ids == expect(idefics3, CHAT_TEXT, [image])
    assert cuts  # some step ended inside a crop's run, its rows sliced


def encode_as_the_engine(llm, images) -> torch.Tensor:
    """The engine's features of ``images``: each image expanded by its processor, the crops'
    encoder inputs concatenated as the encoder cache concatenates them, through the model's
    ``embed_multimodal``."""
    processor = llm.llm_engine.input_processor.multimodal
    data = [run[2] for image in images for run in processor.expand(image, "image")[1]]
    inputs = {key: torch.cat([d[key] for d in data]) for key in data[0]}
    with torch.no_grad():
        return llm.llm_engine.executor.driver.encoder_cache.model.embed_multimodal(**inputs)


@pytest.mark.parametrize("splitting", [True, False])
def test_a_padded_batch_of_prompts_encodes_as_transformers(llm, idefics3, monkeypatch, splitting):
    # transformers' processor pads a batch of prompts with fewer crops by whole zero crops (and
    # their zero pixel_attention_mask), which its model drops; every real crop has the tower's
    # full size and an all-ones mask. The engine processes each image alone, never padded.
    hf_model, image_processor = idefics3[1], idefics3[2].image_processor
    for processor in (image_processor, llm.llm_engine.input_processor.multimodal.image_processor):
        monkeypatch.setattr(processor, "do_image_splitting", splitting)
    prompts = [[make_image(9), make_image(10, (200, 50))], [make_image(11, (20, 30))]]
    batch = image_processor(images=prompts, return_tensors="pt")
    real = batch["pixel_attention_mask"].flatten(2).any(-1)  # [prompts, crops]
    assert not real.all()  # padding crops are there ...
    assert batch["pixel_attention_mask"][real].all()  # ... and no real crop is padded
    with torch.no_grad():
        want = hf_model.get_image_features(
            batch["pixel_values"], batch["pixel_attention_mask"]
        ).pooler_output
    got = encode_as_the_engine(llm, [image for images in prompts for image in images])
    torch.testing.assert_close(got, torch.cat(want), rtol=1e-5, atol=1e-5)


def test_a_partly_padded_crop_is_masked_as_transformers_masks_it(llm, idefics3):
    # no transformers processor pads part of a crop; one padded by hand (bottom and right, as
    # the processors pad) checks that the mask reaches the tower as in transformers
    model = llm.llm_engine.executor.driver.encoder_cache.model
    pixel_values = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    mask = torch.zeros(1, 32, 32, dtype=torch.bool)
    mask[:, :20, :24] = True  # 3 x 3 patches of 8 pixels hold image pixels
    pixel_values[:, :, ~mask[0]] = 0
    with torch.no_grad():
        want = idefics3[1].get_image_features(pixel_values[None], mask[None]).pooler_output[0]
        got = model.embed_multimodal(pixel_values, mask)
        unmasked = model.embed_multimodal(pixel_values)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(unmasked, want, atol=1e-3)  # the mask moves the features
