"""A tiny random LLaVA checkpoint (CLIP tower, projector, Llama) with its processor, for the
multimodal tests, and the images and reference helpers they share."""

from __future__ import annotations

import base64
import copy
import functools
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


def tiny_vision_language_parts(
    tokenizer,
    added_tokens,
    chat_template: str,
    vision_config_class,
    image_size: int,
    patch_size: int,
):
    """``(tokenizer, vision_config, text_config)`` of the tiny vision-language models: a copy
    of ``tokenizer`` with ``added_tokens`` (special) and ``chat_template``, a vision tower of
    ``vision_config_class`` (2 layers, width 32, ``image_size`` pixels in ``patch_size``
    patches) and :func:`model_fixtures.tiny_config`'s Llama over that tokenizer's vocabulary,
    512 positions."""
    from tests.model_fixtures import tiny_config

    tok = copy.deepcopy(tokenizer)
    tok.add_tokens(list(added_tokens), special_tokens=True)
    tok.chat_template = chat_template
    vision = tiny_vision_config(vision_config_class, image_size, patch_size)
    return tok, vision, tiny_config("llama", vocab_size=len(tok), max_position_embeddings=512)


def tiny_vision_config(vision_config_class, image_size: int, patch_size: int):
    """A tiny vision tower's config of ``vision_config_class`` (CLIP's, SigLIP's...): 2 layers,
    width 32, 2 heads, ``image_size`` pixels in ``patch_size`` patches."""
    return vision_config_class(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=image_size,
        patch_size=patch_size,
    )


def build_llava(directory: Path, tokenizer, seed: int = 0):
    """Save a tiny random ``LlavaForConditionalGeneration`` (float32; Llama of 2 layers, width
    64; CLIP of 2 layers, width 32, ``vision_feature_layer`` -2, ``default`` strategy), a copy
    of ``tokenizer`` with ``<image>`` added and :data:`CHAT_TEMPLATE`, and a ``LlavaProcessor``
    (``CLIPImageProcessor`` at 56 pixels) into ``directory``.

    Returns ``(directory, hf_model, processor)``.
    """
    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    tok, vision, text = tiny_vision_language_parts(
        tokenizer, [IMAGE_TOKEN], CHAT_TEMPLATE, CLIPVisionConfig, IMAGE_SIZE, PATCH_SIZE
    )
    config = LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_id=tok.convert_tokens_to_ids(IMAGE_TOKEN),
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
    )
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
    build = functools.partial(LlavaForConditionalGeneration, config)
    return save_tiny_vision_language(
        directory, build, "model.multi_modal_projector", processor, seed
    )


def save_tiny_vision_language(directory: Path, build, projector: str, processor, seed: int = 0):
    """Build the model (``build``: its class bound to its config) from ``seed``, widen the
    spread of its ``projector`` submodule's weights (so that image features move the tokens),
    and save it (float32) and ``processor`` into ``directory``.

    Returns ``(directory, hf_model, processor)``.
    """
    torch.manual_seed(seed)
    model = build().eval()
    with torch.no_grad():
        for p in model.get_submodule(projector).parameters():
            p.normal_(0, 0.5)
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


def record_partial_runs(encoder_cache, monkeypatch) -> list[tuple[int, int]]:
    """A list that each step's ``[lo, hi)`` part of an image's placeholder run is appended to
    when the step feeds less than the whole run (a prefill chunk ending inside the image),
    recorded by wrapping ``encoder_cache.step_embeddings`` for the test."""
    cuts = []
    step_embeddings = encoder_cache.step_embeddings

    def recording(plan, query_start_list):
        for seq in plan.sequences:
            start = seq.num_computed_tokens
            for f in seq.mm_features:
                part = f.overlap(start, start + len(seq.token_ids))
                if part is not None and part[1] - part[0] < f.mm_position.length:
                    cuts.append(part)
        return step_embeddings(plan, query_start_list)

    monkeypatch.setattr(encoder_cache, "step_embeddings", recording)
    return cuts
