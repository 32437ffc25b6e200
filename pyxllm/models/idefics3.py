"""Idefics3 (``Idefics3ForConditionalGeneration``: SmolVLM, Idefics3-8B) and SmolVLM2
(``SmolVLMForConditionalGeneration``, transformers' copy of Idefics3 under ``model_type``
``smolvlm``): a SigLIP-style vision tower, a pixel-shuffle connector and a Llama language model.

The language model is pyxllm's own :class:`~pyxllm.models.llama.LlamaForCausalLM` (through
:class:`~pyxllm.models.vision_language.LlamaVisionLanguageModel`). The vision tower
(``Idefics3VisionTransformer``) and the connector (``Idefics3Connector``: the pixel shuffle,
which folds each ``scale_factor x scale_factor`` square of patch features into one vector,
then a linear projection to the language model's width) are transformers' own modules, built
from the checkpoint's config and loaded with its tensors: they run once per image crop, never
in a decode step, and transformers' copy is the reference the tests compare with (the same
reasoning as LLaVA's CLIP tower, see :mod:`pyxllm.models.llava`).

Flow (transformers' ``Idefics3Model.get_image_features``): each crop ``[3, S, S]`` of an image
(:class:`~pyxllm.engine.multimodal.Idefics3MultiModalProcessor` cuts them with transformers'
image processor) through the tower's last hidden state, post-layernormed, and the connector:
``(S / patch)^2 / scale_factor^2`` features per crop (``image_seq_len``, 64 for SmolVLM).
Each crop's ``pixel_attention_mask`` (1 on image pixels, 0 on padding), when the image
processor makes one, becomes the tower's patch attention mask as transformers makes it: a
patch is attended when any of its pixels is. transformers' processors never pad part of a crop
(every crop is resized to the tower's full size; only whole crops pad a batch of prompts, and
those are dropped), so the mask is all ones in practice, the same as passing none.

Checkpoint names (transformers 4.4x and 5 alike): ``model.vision_model.*``,
``model.connector.*``, ``model.text_model.*`` and ``lm_head.weight``.
"""

from __future__ import annotations

import torch

from pyxllm.models.vision_language import LlamaVisionLanguageModel

_RENAMES = (
    ("model.text_model.", "language_model.model."),
    ("lm_head.", "language_model.lm_head."),
    ("model.vision_model.", "vision_model."),
    ("model.connector.", "connector."),
)


class Idefics3ForConditionalGeneration(LlamaVisionLanguageModel):
    """Idefics3 for the paged executor: ``embed_multimodal(pixel_values [N, 3, S, S],
    pixel_attention_mask [N, S, S] | None) -> [N * image_seq_len, hidden]`` (``N`` crops), the
    rest as :class:`LlamaVisionLanguageModel`.

    A config that ties the word embeddings at its top level (transformers ties Idefics3's LM
    head to the text model's embedding from it) ties the Llama's too.

    Raises:
        ValueError: a ``text_config`` that is not a Llama-style decoder.
    """

    def __init__(self, config) -> None:
        if getattr(config, "tie_word_embeddings", False):
            config.text_config.tie_word_embeddings = True
        super().__init__(config)
        tower, connector = self.vision_classes()
        dtype = torch.get_default_dtype()
        self.vision_model = tower(config.vision_config).to(dtype=dtype).eval()
        self.connector = connector(config).to(dtype=dtype)

    @staticmethod
    def vision_classes() -> tuple[type, type]:
        """transformers' vision tower and connector classes of this family."""
        from transformers.models.idefics3.modeling_idefics3 import (
            Idefics3Connector,
            Idefics3VisionTransformer,
        )

        return Idefics3VisionTransformer, Idefics3Connector

    def rename_checkpoint_tensor(self, name: str) -> str | None:
        """A checkpoint tensor's name in this module (see the module docstring); ``None`` for
        a tied LM head."""
        for old, new in _RENAMES:
            if name.startswith(old):
                name = new + name.removeprefix(old)
                break
        if name == self.lm_head_name and self.tied_lm_head:
            return None
        return name

    def embed_multimodal(
        self, pixel_values: torch.Tensor, pixel_attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Connector outputs of ``N`` crops ``[N, 3, S, S]`` -> ``[N * image_seq_len,
        hidden]`` in the model's dtype, crops in order. ``pixel_attention_mask [N, S, S]``
        (bool or int, nonzero on image pixels; ``None``: all image) masks the patches that
        hold no image pixel, as transformers' ``Idefics3Model.get_image_features`` does."""
        weight = self.connector.modality_projection.proj.weight
        patch_attention_mask = None
        if pixel_attention_mask is not None:
            size = self.vision_model.patch_size
            grid = pixel_attention_mask.unfold(1, size, size).unfold(2, size, size)
            patch_attention_mask = grid.sum(dim=(-1, -2)) > 0
        hidden = self.vision_model(
            pixel_values.to(weight), patch_attention_mask=patch_attention_mask
        ).last_hidden_state
        features = self.connector(hidden)
        return features.reshape(-1, features.shape[-1])


class SmolVLMForConditionalGeneration(Idefics3ForConditionalGeneration):
    """SmolVLM2 (``model_type`` ``smolvlm``, e.g. HuggingFaceTB/SmolVLM2-256M-Video-Instruct):
    Idefics3's layout, checkpoint names and flow with transformers' ``SmolVLMVisionTransformer``
    and ``SmolVLMConnector``; images only (its videos are not served).

    Raises:
        ValueError: a ``text_config`` that is not a Llama-style decoder.
    """

    @staticmethod
    def vision_classes() -> tuple[type, type]:
        """transformers' SmolVLM vision tower and connector classes."""
        from transformers.models.smolvlm.modeling_smolvlm import (
            SmolVLMConnector,
            SmolVLMVisionTransformer,
        )

        return SmolVLMVisionTransformer, SmolVLMConnector
