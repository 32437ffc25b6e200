"""Tiny random Idefics3 (SmolVLM) and SmolVLM2 checkpoints: a SigLIP-style tower, the
pixel-shuffle connector and a Llama, saved with their processors, for the multimodal tests."""

from __future__ import annotations

import functools
import json
from pathlib import Path

from tests.llava_fixtures import save_tiny_vision_language, tiny_vision_language_parts

IMAGE_TOKEN = "<image>"
# crops of 32 pixels in 8-pixel patches (16 per crop), pixel-shuffled by 2: 4 features a crop;
# images are resized to at most 64 pixels a side, so up to 2 x 2 crops and the global image
CROP_SIZE, PATCH_SIZE, SCALE_FACTOR = 32, 8, 2
IMAGE_SEQ_LEN = (CROP_SIZE // PATCH_SIZE) ** 2 // SCALE_FACTOR**2
# the image processors' sizes: crops of CROP_SIZE pixels, images resized to at most 2 crops a side
IMAGE_SIZES = {
    "size": {"longest_edge": 2 * CROP_SIZE},
    "max_image_size": {"longest_edge": CROP_SIZE},
}
# SmolVLM's chat template (HuggingFaceTB/SmolVLM-256M-Instruct): it loops over content parts
CHAT_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}"
    "<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
SPECIAL_TOKENS = [
    "<fake_token_around_image>",
    IMAGE_TOKEN,
    "<end_of_utterance>",
    "<global-img>",
    *(f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)),
]


def build_idefics3(directory: Path, tokenizer, seed: int = 0):
    """Save a tiny random ``Idefics3ForConditionalGeneration`` (float32; the towers of
    :func:`~llava_fixtures.tiny_vision_language_parts`, :data:`CROP_SIZE`-pixel crops), a copy of
    ``tokenizer`` with SmolVLM's image tokens added and :data:`CHAT_TEMPLATE`, and an
    ``Idefics3Processor`` (image splitting on, images at most 64 pixels a side) into
    ``directory``.

    Returns ``(directory, hf_model, processor)``.
    """
    from transformers import (
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3ImageProcessorPil,
        Idefics3Processor,
    )
    from transformers.models.idefics3.configuration_idefics3 import Idefics3VisionConfig

    tok, config = _tiny_config(tokenizer, Idefics3Config, Idefics3VisionConfig)
    processor = Idefics3Processor(
        image_processor=Idefics3ImageProcessorPil(**IMAGE_SIZES),
        tokenizer=tok,
        image_seq_len=IMAGE_SEQ_LEN,
        chat_template=CHAT_TEMPLATE,
    )
    build = functools.partial(Idefics3ForConditionalGeneration, config)
    return save_tiny_vision_language(directory, build, "model.connector", processor, seed)


def build_smolvlm(directory: Path, tokenizer, seed: int = 0):
    """Save a tiny random ``SmolVLMForConditionalGeneration`` (SmolVLM2; the towers, sizes and
    tokenizer of :func:`build_idefics3`), its ``SmolVLMImageProcessor`` (PIL), tokenizer and
    SmolVLM2's ``processor_config.json`` into ``directory``: a SmolVLM2 checkpoint's files but
    the video processor's.

    Returns ``(directory, hf_model, processor)``, ``processor`` the reference's: an
    ``Idefics3Processor`` over the SmolVLM image processor, which writes what
    ``SmolVLMProcessor`` writes for images (that class needs torchvision and ``num2words``).
    """
    from transformers import Idefics3Processor, SmolVLMConfig, SmolVLMForConditionalGeneration
    from transformers.models.smolvlm.configuration_smolvlm import SmolVLMVisionConfig
    from transformers.models.smolvlm.image_processing_pil_smolvlm import (
        SmolVLMImageProcessorPil,
    )

    tok, config = _tiny_config(tokenizer, SmolVLMConfig, SmolVLMVisionConfig)
    image_processor = SmolVLMImageProcessorPil(**IMAGE_SIZES)
    build = functools.partial(SmolVLMForConditionalGeneration, config)
    directory, model, _ = save_tiny_vision_language(
        directory, build, "model.connector", image_processor, seed
    )
    tok.save_pretrained(directory)
    (directory / "processor_config.json").write_text(
        json.dumps({"image_seq_len": IMAGE_SEQ_LEN, "processor_class": "SmolVLMProcessor"})
    )
    processor = Idefics3Processor(
        image_processor=image_processor, tokenizer=tok, image_seq_len=IMAGE_SEQ_LEN
    )
    return directory, model, processor


def _tiny_config(tokenizer, config_class, vision_config_class):
    """``(tokenizer, config)``: the tiny parts with :data:`SPECIAL_TOKENS`, in ``config_class``
    (Idefics3's or SmolVLM's) with an untied LM head."""
    tok, vision, text = tiny_vision_language_parts(
        tokenizer, SPECIAL_TOKENS, CHAT_TEMPLATE, vision_config_class, CROP_SIZE, PATCH_SIZE
    )
    config = config_class(
        vision_config=vision,
        text_config=text,
        image_token_id=tok.convert_tokens_to_ids(IMAGE_TOKEN),
        scale_factor=SCALE_FACTOR,
        tie_word_embeddings=False,
    )
    return tok, config
