"""A tiny random Gemma 3 vision-language checkpoint (``Gemma3ForConditionalGeneration``: a
SigLIP tower, Gemma 3's projector and a Gemma 3 text model with local and global layers), saved
with its tokenizer, chat template and ``Gemma3Processor``, for the multimodal tests."""

from __future__ import annotations

import copy
import functools
from pathlib import Path

from tests.llava_fixtures import save_tiny_vision_language, tiny_vision_config

BOI, EOI, SOFT = "<start_of_image>", "<end_of_image>", "<image_soft_token>"
# 32-pixel images in 4-pixel patches (8 x 8), average-pooled 2 x 2 to 16 tokens an image: more
# than the text model's window of 6, so a local layer's image token sees neither its whole image
# nor only the tokens before it
IMAGE_SIZE, PATCH_SIZE, MM_TOKENS_PER_IMAGE = 32, 4, 16
# Gemma 3's chat template, shortened: it loops over content parts, an image is <start_of_image>
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<start_of_turn>"
    "{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] | trim }}{% else %}"
    "{% for item in message['content'] %}{% if item['type'] == 'image' %}<start_of_image>"
    "{% elif item['type'] == 'text' %}{{ item['text'] | trim }}{% endif %}{% endfor %}"
    "{% endif %}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def build_gemma3(directory: Path, tokenizer, seed: int = 0):
    """Save a tiny random ``Gemma3ForConditionalGeneration`` (float32; the Gemma 3 text model of
    :func:`model_fixtures.tiny_config` ``gemma3``: 4 layers local-local-global-local, a window of
    6 tokens, tied embeddings; a SigLIP tower of 2 layers, width 32, over :data:`IMAGE_SIZE`
    pixels; :data:`MM_TOKENS_PER_IMAGE` tokens an image), a copy of ``tokenizer`` with Gemma 3's
    image and turn tokens (named ``boi_token``, ``eoi_token``, ``image_token`` as Gemma's
    tokenizer names them) and :data:`CHAT_TEMPLATE`, and a ``Gemma3Processor`` (transformers'
    PIL image processor at :data:`IMAGE_SIZE` pixels, pan-and-scan off) into ``directory``.

    Returns ``(directory, hf_model, processor)``.
    """
    from transformers import (
        AutoTokenizer,
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        Gemma3Processor,
        SiglipVisionConfig,
    )
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    from tests.model_fixtures import tiny_config

    tok = copy.deepcopy(tokenizer)
    tok.add_tokens([BOI, EOI, SOFT, "<start_of_turn>", "<end_of_turn>"], special_tokens=True)
    directory = Path(directory)
    tok.save_pretrained(directory)  # reloaded to name the image tokens as Gemma's tokenizer does
    tok = AutoTokenizer.from_pretrained(
        directory, extra_special_tokens={"boi_token": BOI, "eoi_token": EOI, "image_token": SOFT}
    )
    tok.chat_template = CHAT_TEMPLATE
    vision = tiny_vision_config(SiglipVisionConfig, IMAGE_SIZE, PATCH_SIZE)
    # an LM head of its own: with the tied one, greedy tokens of this tiny model repeat the first
    text = tiny_config("gemma3", vocab_size=len(tok), max_position_embeddings=512)
    text.tie_word_embeddings = False
    config = Gemma3Config(
        text_config=text.to_dict(),
        vision_config=vision.to_dict(),
        mm_tokens_per_image=MM_TOKENS_PER_IMAGE,
        boi_token_index=tok.convert_tokens_to_ids(BOI),
        eoi_token_index=tok.convert_tokens_to_ids(EOI),
        image_token_index=tok.convert_tokens_to_ids(SOFT),
        initializer_range=text.initializer_range,
        tie_word_embeddings=False,  # what transformers initializes every weight with
    )
    image_processor = Gemma3ImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    processor = Gemma3Processor(
        image_processor=image_processor,
        tokenizer=tok,
        chat_template=CHAT_TEMPLATE,
        image_seq_length=MM_TOKENS_PER_IMAGE,
    )
    build = functools.partial(Gemma3ForConditionalGeneration, config)
    return save_tiny_vision_language(
        directory, build, "model.multi_modal_projector", processor, seed
    )
