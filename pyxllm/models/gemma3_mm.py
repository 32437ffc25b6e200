"""Gemma 3 with images (``Gemma3ForConditionalGeneration``: the 4B, 12B and 27B checkpoints): a
SigLIP vision tower, Gemma 3's projector and the Gemma 3 text model.

The language model is pyxllm's own :class:`~pyxllm.models.gemma3.Gemma3ForCausalLM` (local and
global layers, q/k norms, embeddings scaled by ``sqrt(hidden_size)``). The vision tower is
transformers' ``SiglipVisionModel`` and the projector transformers' own
``Gemma3MultiModalProjector`` (each image's ``(image_size / patch_size)^2`` patch features
average-pooled to ``mm_tokens_per_image``, normed by a Gemma RMSNorm, ``mm_soft_emb_norm``,
then multiplied by ``mm_input_projection_weight``), built from the checkpoint's config and loaded
with its tensors: they run once per image, never in a decode step, and transformers' copy is
the reference the tests compare with (the same reasoning as LLaVA's CLIP tower, see
:mod:`pyxllm.models.llava`).

Flow (transformers' ``Gemma3Model``): the prompt's ``<start_of_image>`` becomes ``\\n\\n
<start_of_image>``, ``mm_tokens_per_image`` ``<image_soft_token>`` and ``<end_of_image>\\n\\n``
(:class:`~pyxllm.engine.multimodal.Gemma3MultiModalProcessor`); the soft tokens' embeddings are
replaced by the image's projected features, which are not scaled by ``sqrt(hidden_size)`` (only
the token embeddings are, inside transformers' ``Gemma3TextScaledWordEmbedding``).

The soft tokens of one image attend to each other bidirectionally (transformers'
``create_masks_for_vision_model``: a global layer ``OR(causal, same image)``, a local one
``AND(sliding window, OR(causal, same image))``): :attr:`bidirectional_image_attention` tells the
engine, whose scheduler then never ends a prefill chunk inside an image and whose attention
lets each image token see up to its image's last token (``InputBatch.key_limits``).

Checkpoint names: LLaVA's layouts (:func:`~pyxllm.models.llava.llava_checkpoint_name`): the
Hub's and transformers 5's ``language_model.model.*``, ``vision_tower.*`` (with or without its
``vision_model.`` level), ``multi_modal_projector.*``, and transformers 4.5x's ``model.*`` and
``lm_head``.
"""

from __future__ import annotations

import torch

from pyxllm.layers.forward_context import current_forward_context
from pyxllm.models.gemma3 import Gemma3ForCausalLM
from pyxllm.models.llava import llava_checkpoint_name
from pyxllm.models.vision_language import LlamaVisionLanguageModel


class Gemma3ForConditionalGeneration(LlamaVisionLanguageModel):
    """Gemma 3 with images for the paged executor: ``embed_multimodal(pixel_values [N, 3, S, S])
    -> [N * mm_tokens_per_image, hidden]``, the rest as :class:`LlamaVisionLanguageModel` over
    :class:`~pyxllm.models.gemma3.Gemma3ForCausalLM`.

    The top-level config's ``tie_word_embeddings`` (Gemma 3's default: tied) decides whether the
    LM head is the embedding.

    Raises:
        ValueError: a text config :class:`Gemma3ForCausalLM` refuses.
    """

    # the soft tokens of an image attend to each other bidirectionally (see the module docstring)
    bidirectional_image_attention = True

    def __init__(self, config) -> None:
        from transformers import SiglipVisionModel
        from transformers.models.gemma3.modeling_gemma3 import Gemma3MultiModalProjector

        text = config.text_config
        text.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
        super().__init__(config, Gemma3ForCausalLM(text))
        dtype = torch.get_default_dtype()
        self.vision_tower = SiglipVisionModel(config.vision_config).to(dtype=dtype).eval()
        self.multi_modal_projector = Gemma3MultiModalProjector(config).to(dtype=dtype)
        self.tower_level = "vision_model." if hasattr(self.vision_tower, "vision_model") else ""
        self.vocab_size = text.vocab_size

    def rename_checkpoint_tensor(self, name: str) -> str | None:
        """A checkpoint tensor's name in this module (see the module docstring); ``None`` for
        a tied LM head."""
        return llava_checkpoint_name(self, name)

    def embed_multimodal(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Projected features of ``N`` images ``[N, 3, S, S]`` -> ``[N * mm_tokens_per_image,
        hidden]`` in the model's dtype, images in order (transformers'
        ``Gemma3Model.get_image_features``)."""
        weight = self.multi_modal_projector.mm_input_projection_weight
        hidden = self.vision_tower(pixel_values=pixel_values.to(weight.dtype)).last_hidden_state
        features = self.multi_modal_projector(hidden)
        return features.reshape(-1, features.shape[-1])

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        ctx = current_forward_context()
        mm = None if ctx is None else ctx.multimodal
        if mm is not None and self.config.image_token_id >= self.vocab_size:
            # an image token outside the vocabulary has no embedding row: any row serves, as
            # the image's features replace it (transformers embeds token 0 there)
            input_ids = input_ids.index_fill(0, mm.indices, 0)
        return super().forward(input_ids, positions)
