"""Qwen2-VL, Qwen2.5-VL and Qwen3-VL (``Qwen2VLForConditionalGeneration``,
``Qwen2_5_VLForConditionalGeneration``, ``Qwen3VLForConditionalGeneration``): a ViT over 14-
(Qwen3-VL: 16-) pixel patches whose merger folds each 2 x 2 square of patches into one token,
and a Qwen2 (Qwen3-VL: Qwen3) language model with multimodal rotary positions (mRoPE).

The language model is pyxllm's own :class:`~pyxllm.models.llama.LlamaForCausalLM` with Qwen2's
QKV bias (as :class:`~pyxllm.models.qwen2.Qwen2ForCausalLM`) and one
:class:`~pyxllm.layers.rotary_embedding.MRotaryEmbedding` shared by its layers: the config's
``mrope_section`` cuts the rotary frequencies into temporal, height and width sections. The
vision tower is transformers' own module (``Qwen2VisionTransformerPretrainedModel``,
``Qwen2_5_VisionTransformerPretrainedModel``, with its window attention and merger), built from
the checkpoint's ``vision_config`` and loaded with its tensors: it runs once per image, never
in a decode step, and transformers' copy is the reference the tests compare with (the same
reasoning as LLaVA's CLIP tower, see :mod:`pyxllm.models.llava`).

Flow (transformers' ``get_image_features``): transformers' image processor
(``Qwen2VLImageProcessor``) resizes an image to a multiple of 28 pixels a side and cuts it into
``grid_thw = (1, H / 14, W / 14)`` patches, ``pixel_values [t * h * w, 3 * 2 * 14 * 14]``
(each patch twice over time); the tower makes ``t * h * w / merge^2`` features. The engine
expands the image's ``<|image_pad|>`` token to that many placeholder tokens on a ``(t, h /
merge, w / merge)`` grid (:class:`~pyxllm.engine.multimodal.Qwen2VLMultiModalProcessor`); the
scheduler hands each step's ``(temporal, height, width)`` positions
(:func:`~pyxllm.multimodal_inputs.mrope_positions`) to :meth:`forward` as ``positions [3, T]``.

Qwen3-VL adds deepstack: the tower's mergers at ``deepstack_visual_indexes`` make one more
feature row per placeholder token each, which are added to the hidden states of those tokens
after the language model's first layers (one merger a layer, transformers'
``_deepstack_process``); its mRoPE interleaves the sections (see
:class:`~pyxllm.layers.rotary_embedding.MRotaryEmbedding`). Here the encoder's row for a token
is its main feature and its deepstack features side by side, ``[(1 + K) * hidden]``, so the
encoder cache and chunked prefill slice them together.

Checkpoint names: Qwen2-VL's and Qwen2.5-VL's on the Hub (and transformers 5's
``save_pretrained``'s) ``visual.*``, ``model.*`` (the language model) and ``lm_head.weight``;
Qwen3-VL's (and transformers 4.5x's for all three) ``model.visual.*``,
``model.language_model.*`` and ``lm_head.weight``.
"""

from __future__ import annotations

import functools

import torch

from pyxllm.layers.forward_context import current_forward_context
from pyxllm.layers.rotary_embedding import MRotaryEmbedding
from pyxllm.models.build_context import max_model_len_of
from pyxllm.models.config_utils import head_dim_of, rope_parameters
from pyxllm.models.llama import LlamaAttention, LlamaForCausalLM
from pyxllm.models.qwen3 import Qwen3Attention
from pyxllm.models.vision_language import LlamaVisionLanguageModel


def mrope_section_of(text_config) -> list[int]:
    """The config's ``mrope_section`` (transformers 5's ``rope_parameters``, or the older
    ``rope_scaling``).

    Raises:
        ValueError: the config has none.
    """
    for name in ("rope_parameters", "rope_scaling"):
        params = getattr(text_config, name, None)
        if isinstance(params, dict) and params.get("mrope_section"):
            return list(params["mrope_section"])
    raise ValueError("a Qwen2-VL text config without rope_parameters.mrope_section")


class Qwen2VLForConditionalGeneration(LlamaVisionLanguageModel):
    """Qwen2-VL for the paged executor: ``embed_multimodal(pixel_values [P, C], image_grid_thw
    [N, 3]) -> [sum(t * h * w) / merge^2, hidden]`` (``N`` images' patches), ``forward``'s
    ``positions`` ``[3, T]`` (mRoPE) or ``[T]`` (text alone), the rest as
    :class:`LlamaVisionLanguageModel`.

    The top-level config's ``tie_word_embeddings`` (where transformers 5 keeps it) decides
    whether the LM head is the embedding.

    Raises:
        ValueError: a text config without ``mrope_section``, or one :class:`LlamaForCausalLM`
            refuses.
    """

    vision_class = "Qwen2VisionTransformerPretrainedModel"
    vision_module = "transformers.models.qwen2_vl.modeling_qwen2_vl"
    mrope_interleaved = False

    def __init__(self, config) -> None:
        import importlib

        text = config.text_config
        text.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        base, scaling = rope_parameters(text)
        rotary = MRotaryEmbedding(
            head_dim_of(text),
            max_model_len_of(text),
            base,
            mrope_section_of(text),
            scaling,
            interleaved=self.mrope_interleaved,
        )
        attention = self.attention_builder(rotary)
        super().__init__(config, LlamaForCausalLM(text, attention=attention))
        tower = getattr(importlib.import_module(self.vision_module), self.vision_class)
        dtype = torch.get_default_dtype()
        self.visual = tower(config.vision_config).to(dtype=dtype).eval()
        self.spatial_merge_size = config.vision_config.spatial_merge_size

    def attention_builder(self, rotary: MRotaryEmbedding):
        """``(config, layer_idx) -> attention``: Qwen2's (a QKV bias) with ``rotary``."""
        return functools.partial(LlamaAttention, qkv_bias=True, rotary_emb=rotary)

    def rename_checkpoint_tensor(self, name: str) -> str | None:
        """A checkpoint tensor's name in this module (see the module docstring); ``None`` for
        a tied LM head."""
        if name.startswith("model.visual."):
            name = name.removeprefix("model.")
        elif name.startswith("model.language_model."):
            name = "language_model.model." + name.removeprefix("model.language_model.")
        elif name.startswith("model."):
            name = "language_model." + name
        elif name.startswith("lm_head."):
            name = "language_model." + name
        if name == self.lm_head_name and self.tied_lm_head:
            return None
        return name

    def embed_multimodal(
        self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor
    ) -> torch.Tensor:
        """The merged features of the images whose patches are ``pixel_values [P, C]`` (in
        order, ``P = sum(t * h * w)``) on the grids ``image_grid_thw [N, 3]`` int64: ``[P /
        merge^2, hidden]`` in the model's dtype, images in order."""
        weight = self.visual.patch_embed.proj.weight
        out = self.visual(pixel_values.to(weight.dtype), grid_thw=image_grid_thw.to(torch.long))
        return self.features(out)

    def features(self, out) -> torch.Tensor:
        """The rows :meth:`embed_multimodal` returns from the tower's output ``out``: its merged
        features."""
        return out.pooler_output


class Qwen2_5_VLForConditionalGeneration(Qwen2VLForConditionalGeneration):  # noqa: N801
    """Qwen2.5-VL: Qwen2-VL's language model and flow, with Qwen2.5-VL's tower (RMSNorm,
    SwiGLU, window attention in all blocks but ``fullatt_block_indexes``)."""

    vision_class = "Qwen2_5_VisionTransformerPretrainedModel"
    vision_module = "transformers.models.qwen2_5_vl.modeling_qwen2_5_vl"


class Qwen3VLForConditionalGeneration(Qwen2VLForConditionalGeneration):
    """Qwen3-VL (dense): Qwen3's attention (q/k norms) with interleaved mRoPE, transformers'
    ``Qwen3VLVisionModel``, and deepstack (see the module docstring).

    ``embed_multimodal`` returns ``[rows, (1 + K) * hidden]``: each token's main feature then
    its ``K`` deepstack features; :meth:`forward` puts the first in the embeddings and adds
    deepstack feature ``i`` to the token's hidden state after layer ``i``.
    """

    vision_class = "Qwen3VLVisionModel"
    vision_module = "transformers.models.qwen3_vl.modeling_qwen3_vl"
    mrope_interleaved = True

    def attention_builder(self, rotary: MRotaryEmbedding):
        """``(config, layer_idx) -> attention``: Qwen3's (q/k norms) with ``rotary``."""
        return functools.partial(Qwen3Attention, rotary_emb=rotary)

    def features(self, out) -> torch.Tensor:
        """``[P / merge^2, (1 + K) * hidden]``: the merged features of the images, each row
        followed by its ``K`` deepstack features."""
        return torch.cat([out.pooler_output, *out.deepstack_features], dim=-1)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        ctx = current_forward_context()
        mm = None if ctx is None else ctx.multimodal
        if mm is None:
            return self.language_model(input_ids, positions)
        model = self.language_model.model
        main, *deepstack = mm.embeds.split(self.config.text_config.hidden_size, dim=-1)
        hidden = model.embed_input_ids(input_ids)
        hidden = hidden.index_copy(0, mm.indices, main.to(hidden.dtype))
        residual = None
        for i, layer in enumerate(model.layers):
            hidden, residual = layer(positions, hidden, residual)
            if i < len(deepstack):  # the layer's output, then the residual, is the stream
                hidden = hidden.index_add(0, mm.indices, deepstack[i].to(hidden.dtype))
        hidden, _ = model.norm(hidden, residual)
        return hidden
