"""LLaVA (``LlavaForConditionalGeneration``): a CLIP vision tower, a two-layer projector and a
Llama language model.

The language model is pyxllm's own :class:`~pyxllm.models.llama.LlamaForCausalLM` (paged
attention, fused projections, tensor-parallel layers, every runner). The vision tower is
transformers' ``CLIPVisionModel``, built from the checkpoint's ``vision_config`` and loaded
with the checkpoint's tensors: it runs once per image (not per token, and never in a decode
step), outside the paged KV cache, so a native copy would buy little speed and add a second
implementation of CLIP to keep equal to the library's; transformers' is the reference the
tests compare with, and keeping it makes that parity hold by construction. The projector
(``linear_1``, the activation ``projector_hidden_act``, ``linear_2``) is a few lines and is
ours.

Flow (transformers' ``LlavaModel.get_image_features``): the tower's hidden states at
``vision_feature_layer`` (or several layers, concatenated), without the CLS position when
``vision_feature_select_strategy`` is ``default``, projected to the language model's width:
``(H / patch) * (W / patch)`` features per image (one more with ``full``). The engine expands
each ``<image>`` token of a prompt to that many placeholder tokens; the executor runs
:meth:`LlavaForConditionalGeneration.embed_multimodal` once per image and hands the features
for the step's placeholder rows to :meth:`~LlavaForConditionalGeneration.forward` through the
forward context (:class:`~pyxllm.layers.forward_context.MultiModalEmbeddings`).

Checkpoint names: both layouts load, the one transformers 5 saves (``language_model.model.*``,
``language_model.lm_head``, ``vision_tower.*``, ``multi_modal_projector.*``, as the Hub's
llava-hf checkpoints store them) and transformers 4.5x's (``model.language_model.*``,
``model.vision_tower.*``, ``lm_head``); a tower saved with its ``vision_model.`` level loads
into a tower built without it and the reverse.
"""

from __future__ import annotations

import torch
from torch import nn

from pyxllm.models.vision_language import LlamaVisionLanguageModel


class LlavaMultiModalProjector(nn.Module):
    """``linear_2(act(linear_1(x)))``: vision features ``[N, vision_hidden * layers]`` to the
    language model's ``[N, hidden]`` (transformers' ``LlavaMultiModalProjector``)."""

    def __init__(self, config) -> None:
        from transformers.activations import ACT2FN

        super().__init__()
        layers = config.vision_feature_layer
        num_layers = 1 if isinstance(layers, int) else len(layers)
        hidden, bias = config.text_config.hidden_size, config.multimodal_projector_bias
        self.linear_1 = nn.Linear(config.vision_config.hidden_size * num_layers, hidden, bias=bias)
        self.act = ACT2FN[config.projector_hidden_act]
        self.linear_2 = nn.Linear(hidden, hidden, bias=bias)

    def forward(self, image_features: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(image_features)))


class LlavaForConditionalGeneration(LlamaVisionLanguageModel):
    """LLaVA for the paged executor: ``embed_multimodal(pixel_values [N, 3, H, W]) -> [N *
    features, hidden]``, the rest as :class:`LlamaVisionLanguageModel`.

    Raises:
        ValueError: a ``text_config`` that is not a Llama-style decoder.
    """

    def __init__(self, config) -> None:
        from transformers import CLIPVisionModel

        super().__init__(config)
        self.feature_layer = config.vision_feature_layer
        self.select_strategy = config.vision_feature_select_strategy
        dtype = torch.get_default_dtype()
        self.vision_tower = CLIPVisionModel(config.vision_config).to(dtype=dtype).eval()
        self.multi_modal_projector = LlavaMultiModalProjector(config)
        self.tower_level = "vision_model." if hasattr(self.vision_tower, "vision_model") else ""

    def rename_checkpoint_tensor(self, name: str) -> str | None:
        """A checkpoint tensor's name in this module (see the module docstring for the
        layouts); ``None`` for a tied LM head."""
        return llava_checkpoint_name(self, name)

    def embed_multimodal(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Projected image features, ``[N, 3, H, W]`` -> ``[N * F, hidden]`` in the model's
        dtype (``F`` per image, see the module docstring), images in order."""
        pixel_values = pixel_values.to(self.multi_modal_projector.linear_1.weight)
        out = self.vision_tower(pixel_values, output_hidden_states=True)
        layers = self.feature_layer
        picked = [out.hidden_states[i] for i in ([layers] if isinstance(layers, int) else layers)]
        if self.select_strategy == "default":
            picked = [h[:, 1:] for h in picked]
        features = self.multi_modal_projector(torch.cat(picked, dim=-1))
        return features.reshape(-1, features.shape[-1])


def llava_checkpoint_name(model: LlamaVisionLanguageModel, name: str) -> str | None:
    """A checkpoint tensor's name in ``model``, a vision-language model laid out as LLaVA is
    (``language_model``, ``vision_tower``, ``multi_modal_projector``; LLaVA's and Gemma 3's):
    transformers 5's names and transformers 4.5x's (see the module docstring), the tower's
    ``vision_model.`` level as ``model.tower_level`` says; ``None`` for a tied LM head."""
    if name.startswith("model."):
        name = name.removeprefix("model.")
    if name.startswith("lm_head."):
        name = "language_model." + name
    if name.startswith("language_model.") and not name.startswith(
        ("language_model.model.", "language_model.lm_head.")
    ):
        name = "language_model.model." + name.removeprefix("language_model.")
    if name.startswith("vision_tower."):
        rest = name.removeprefix("vision_tower.").removeprefix("vision_model.")
        name = f"vision_tower.{model.tower_level}{rest}"
    if name == model.lm_head_name and model.tied_lm_head:
        return None
    return name
