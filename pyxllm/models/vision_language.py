"""What pyxllm's vision-language models share: pyxllm's Llama (or a model built on it, Gemma
3's) as the language model, whose token embeddings at an image's placeholder positions are
replaced by the image's encoder outputs.

A family (:mod:`pyxllm.models.llava`, :mod:`pyxllm.models.idefics3`,
:mod:`pyxllm.models.qwen2_vl`, :mod:`pyxllm.models.gemma3_mm`) subclasses
:class:`LlamaVisionLanguageModel` and adds its encoder, ``embed_multimodal(**data) -> [rows,
hidden]`` (``data``: the images' encoder inputs, each key's tensors concatenated along dim 0,
e.g. ``pixel_values [N, 3, H, W]``), and ``rename_checkpoint_tensor`` for its checkpoint's
names.
The executor runs the encoder once per image (:mod:`pyxllm.executor.encoder_cache`) and hands
the features for the step's placeholder rows to :meth:`LlamaVisionLanguageModel.forward`
through the forward context (:class:`~pyxllm.layers.forward_context.MultiModalEmbeddings`).
"""

from __future__ import annotations

import torch
from torch import nn

from pyxllm.layers.forward_context import current_forward_context
from pyxllm.models.llama import LlamaForCausalLM


class LlamaVisionLanguageModel(nn.Module):
    """A vision-language model whose language model is :class:`LlamaForCausalLM`, built from
    ``config.text_config`` as ``language_model`` (or the one the family passes, e.g. Qwen2's
    with mRoPE).

    ``forward(input_ids [T] int64, positions [T] int64) -> hidden [T, hidden]``
    (``positions [3, T]`` for mRoPE): the token
    embeddings, with the rows the forward context's ``multimodal`` names replaced by its
    encoder outputs, through the Llama decoder; ``compute_logits`` as Llama's.

    Raises:
        ValueError: a ``text_config`` that is not a Llama-style decoder (see
            :class:`LlamaForCausalLM`).
    """

    packed_modules_mapping = LlamaForCausalLM.packed_modules_mapping
    lm_head_name = "language_model.lm_head.weight"

    def __init__(self, config, language_model: LlamaForCausalLM | None = None) -> None:
        super().__init__()
        self.config = config
        self.image_token_id = config.image_token_id
        self.language_model = (
            LlamaForCausalLM(config.text_config) if language_model is None else language_model
        )

    @property
    def tied_lm_head(self) -> bool:
        """Whether the language model's LM head is its embedding (no tensor of its own)."""
        return bool(getattr(self.config.text_config, "tie_word_embeddings", False))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        ctx = current_forward_context()
        mm = None if ctx is None else ctx.multimodal
        if mm is None:
            return self.language_model(input_ids, positions)
        embeds = self.language_model.model.embed_input_ids(input_ids)
        embeds = embeds.index_copy(0, mm.indices, mm.embeds.to(embeds.dtype))
        return self.language_model.model(None, positions, inputs_embeds=embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.language_model.compute_logits(hidden_states)
