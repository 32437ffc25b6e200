"""A tiny random LLaVA checkpoint (CLIP tower, projector, Llama) with its processor, for the
multimodal tests, and the images and reference helpers they share."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import torch

IMAGE_TOKEN = "<image>"
# 56x56 pixels in 14-pixel patches: 16 features (placeholder tokens) per image
IMAGE_SIZE, PATCH_SIZE = 56, 14
NUM_IMAGE_TOKENS = (IMAGE_SIZE // PATCH_SIZE) ** 2
# string content: "USER: <image>\nWhat is in the picture?\nASSISTANT:"
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- message['role'].upper() + ': ' + message['content'] + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- 'ASSISTANT:' }}{%- endif %}"
)


def build_llava(directory: Path, tokenizer, seed: int = 0):
    """Save a tiny random ``LlavaForConditionalGeneration`` (float32; Llama of 2 layers, width
    64; CLIP of 2 layers, width 32, ``vision_feature_layer`` -2, ``default`` strategy), a copy
    of ``tokenizer`` with ``<image>`` added and :data:`CHAT_TEMPLATE`, and a ``LlavaProcessor``
    (``CLIPImageProcessor`` at 56 pixels) into ``directory``.

    Returns ``(directory, hf_model, processor)``.
    """
    import copy

    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    tok = copy.deepcopy(tokenizer)
    tok.add_tokens([IMAGE_TOKEN], special_tokens=True)
    tok.chat_template = CHAT_TEMPLATE
    vision = CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=IMAGE_SIZE,
        patch_size=PATCH_SIZE,
    )
    text = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        num_hidden_layers=2,
        max_position_embeddings=256,
        initializer_range=0.25,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    config = LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_id=tok.convert_tokens_to_ids(IMAGE_TOKEN),
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
    )
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config).eval()
    # a larger projector spread makes image features move the tokens
    with torch.no_grad():
        for p in model.model.multi_modal_projector.parameters():
            p.normal_(0, 0.5)
    image_processor = CLIPImageProcessor(
        size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    )
    processor = LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tok,
        patch_size=PATCH_SIZE,
        vision_feature_select_strategy="default",
        image_token=IMAGE_TOKEN,
        num_additional_image_tokens=1,
        chat_template=CHAT_TEMPLATE,
    )
    model.config.dtype = torch.float32
    model.save_pretrained(directory)
    processor.save_pretrained(directory)
    return Path(directory), model, processor


def make_image(seed: int, size: tuple[int, int] = (40, 60)):
    """A random RGB PIL image of ``size`` (width, height)."""
    import numpy as np
    from PIL import Image

    rng = np.random.RandomState(seed)
    return Image.fromarray((rng.rand(size[1], size[0], 3) * 255).astype("uint8"))


def data_url(image) -> str:
    """``image`` as a ``data:image/png;base64,`` URL."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def reference_tokens(hf_model, processor, text: str, images, max_new_tokens: int) -> list[int]:
    """transformers' greedy tokens for ``text`` (with one ``<image>`` per image) and
    ``images``, in float32."""
    inputs = processor(images=images or None, text=text, return_tensors="pt")
    with torch.no_grad():
        out = hf_model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()
