"""Tiny random Qwen2-VL, Qwen2.5-VL and Qwen3-VL checkpoints (transformers' vision tower, a
Qwen2 or Qwen3 with mRoPE), saved with their image processor, and transformers' reference for
them.

transformers' ``Qwen2_5_VLProcessor`` needs torchvision for its video half, so the reference
expands the image token itself, as that processor does: ``<|image_pad|>`` repeated ``t * h * w
/ merge^2`` times for the image processor's ``image_grid_thw``.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch

IMAGE_TOKEN = "<|image_pad|>"
IMAGE = f"<|vision_start|>{IMAGE_TOKEN}<|vision_end|>"
SPECIAL_TOKENS = ["<|vision_start|>", "<|vision_end|>", IMAGE_TOKEN, "<|video_pad|>"]
# 14-pixel patches (Qwen3-VL: 16) merged 2 x 2: images are resized to 28-pixel multiples (32),
# 4 to 16 merged tokens
MERGE_SIZE = 2
# Qwen2-VL's chat template, shortened: it loops over content parts
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for content in message['content'] %}{% if content['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif content['type'] == 'text' %}"
    "{{ content['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_qwen2_vl(directory: Path, tokenizer, version: str = "2.5", seed: int = 0):
    """Save a tiny random ``Qwen2_5_VLForConditionalGeneration`` (``version`` "2.5"),
    ``Qwen2VLForConditionalGeneration`` ("2") or ``Qwen3VLForConditionalGeneration`` ("3") in
    float32 (a Qwen2, or Qwen3 with q/k norms, of 2 layers, width 64, 4 heads of 16,
    ``mrope_section`` [2, 3, 3], interleaved for Qwen3-VL; a vision tower of 2 blocks, width 32,
    Qwen2.5-VL's with window attention in block 0, Qwen3-VL's with a deepstack merger after
    each block), a copy of ``tokenizer`` with the vision tokens and :data:`CHAT_TEMPLATE`, and a
    ``Qwen2VLImageProcessor`` (4 to 16 merged tokens an image) into ``directory``.

    Returns ``(directory, hf_model, image_processor, tokenizer)``.
    """
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
        Qwen3VLConfig,
        Qwen3VLForConditionalGeneration,
    )
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    tok = copy.deepcopy(tokenizer)
    tok.add_tokens(SPECIAL_TOKENS, special_tokens=True)
    tok.chat_template = CHAT_TEMPLATE
    start, end, image, video = tok.convert_tokens_to_ids(SPECIAL_TOKENS)
    text = dict(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.25,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
        bos_token_id=1,
        eos_token_id=2,
    )
    patch = 16 if version == "3" else 14
    common = dict(patch_size=patch, spatial_merge_size=MERGE_SIZE, temporal_patch_size=2)
    if version == "3":
        config_cls, model_cls = Qwen3VLConfig, Qwen3VLForConditionalGeneration
        text.update(head_dim=16)
        text["rope_parameters"] = {**text["rope_parameters"], "mrope_interleaved": True}
        vision = dict(
            depth=2,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            out_hidden_size=64,
            num_position_embeddings=16,
            deepstack_visual_indexes=[0, 1],
            **common,
        )
    elif version == "2.5":
        config_cls, model_cls = Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
        vision = dict(
            depth=2,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            out_hidden_size=64,
            window_size=56,
            fullatt_block_indexes=[1],
            **common,
        )
    else:
        config_cls, model_cls = Qwen2VLConfig, Qwen2VLForConditionalGeneration
        vision = dict(depth=2, embed_dim=32, mlp_ratio=2, num_heads=2, hidden_size=64, **common)
    config = config_cls(
        text_config=text,
        vision_config=vision,
        image_token_id=image,
        video_token_id=video,
        vision_start_token_id=start,
        vision_end_token_id=end,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():  # wide mergers, so that image features move the tokens
        visual = model.model.visual
        for merger in [visual.merger, *getattr(visual, "deepstack_merger_list", [])]:
            for p in merger.parameters():
                p.normal_(0, 0.5)
    model.config.dtype = torch.float32
    model.save_pretrained(directory)
    side = patch * MERGE_SIZE
    image_processor = Qwen2VLImageProcessorPil(
        min_pixels=side * side * 4, max_pixels=side * side * 16, patch_size=patch, merge_size=2
    )
    image_processor.save_pretrained(directory)
    tok.save_pretrained(directory)
    return Path(directory), model, image_processor, tok


def reference_inputs(qwen, text: str, images) -> dict:
    """transformers' model inputs for ``text`` (one :data:`IMAGE_TOKEN` per image) and
    ``images``, with each image token expanded as ``Qwen2VLProcessor`` does."""
    _, model, image_processor, tok = qwen
    inputs = {}
    if images:
        out = image_processor(images=images, return_tensors="pt")
        inputs = {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}
        pieces = text.split(IMAGE_TOKEN)
        counts = (out["image_grid_thw"].prod(-1) // MERGE_SIZE**2).tolist()
        text = pieces[0] + "".join(
            IMAGE_TOKEN * n + piece for n, piece in zip(counts, pieces[1:], strict=True)
        )
    ids = torch.tensor([tok.encode(text, add_special_tokens=False)])
    inputs.update(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        mm_token_type_ids=(ids == model.config.image_token_id).int(),
    )
    return inputs


def reference_tokens(qwen, text: str, images, max_new_tokens: int) -> list[int]:
    """transformers' greedy tokens (float32) for ``text`` and ``images``."""
    inputs = reference_inputs(qwen, text, images)
    with torch.no_grad():
        out = qwen[1].generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()
