"""Images in prompts: the model's own image processor, placeholder expansion and content hashes.

vLLM's multimodal processing is the model: each image of a request is preprocessed once, in the
front door (:class:`~pyxllm.engine.input_processor.InputProcessor`), by transformers' image
processor saved with the checkpoint (``AutoImageProcessor``: ``CLIPImageProcessor`` for LLaVA;
without torchvision transformers falls back to its PIL implementation). The prompt's image
token (``<image>``, the config's ``image_token_id``) is expanded to one placeholder token per
feature vector the model's encoder makes of the image (as ``LlavaProcessor`` expands the text),
and the request carries a :class:`~pyxllm.multimodal_inputs.MultiModalFeatureSpec` per image:
its placeholder run, its ``pixel_values`` and a hash of them. The executor runs the encoder
once per image (:mod:`pyxllm.executor.encoder_cache`), and the hash enters the prefix-cache
hash of every block the run touches (:meth:`pyxllm.engine.request.Request.block_extra_keys`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

from pyxllm.engine.errors import InvalidRequestError
from pyxllm.multimodal_inputs import (
    DEFAULT_MEDIA,
    MediaPolicy,
    MultiModalFeatureSpec,
    PlaceholderRange,
)

# vLLM's default per-modality limit (--limit-mm-per-prompt)
DEFAULT_MM_LIMIT = 999
MODALITIES = ("image",)


def parse_mm_limits(value: str | Mapping[str, int] | None) -> dict[str, int]:
    """``--limit-mm-per-prompt``: vLLM's ``image=N`` (comma-separated per modality) or its JSON
    object ``{"image": N}``; ``None``: :data:`DEFAULT_MM_LIMIT` per modality.

    Raises:
        ValueError: an unknown modality, a count that is not an integer >= 0, or text of
            neither form (naming the flag).
    """
    limits = dict.fromkeys(MODALITIES, DEFAULT_MM_LIMIT)
    if value is None:
        return limits
    given: Mapping[str, Any]
    if isinstance(value, Mapping):
        given = value
    elif value.strip().startswith("{"):
        try:
            given = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--limit-mm-per-prompt: not a JSON object ({exc})") from None
    else:
        given = {}
        for item in filter(None, (s.strip() for s in value.split(","))):
            name, sep, count = item.partition("=")
            if not sep:
                raise ValueError(f"--limit-mm-per-prompt: expected image=N, got {item!r}")
            given[name.strip()] = count.strip()
    for name, count in given.items():
        if name not in MODALITIES:
            raise ValueError(
                f"--limit-mm-per-prompt: unknown modality {name!r} (served: "
                f"{', '.join(MODALITIES)})"
            )
        try:
            number = int(count)
        except (TypeError, ValueError):
            number = -1
        if number < 0 or isinstance(count, bool):
            raise ValueError(
                f"--limit-mm-per-prompt: {name} must be an integer >= 0, got {count!r}"
            )
        limits[name] = number
    return limits


def image_hash(pixel_values) -> str:
    """Hex SHA-256 of processed ``pixel_values`` (their shape, dtype and bytes): equal images
    processed alike share it, any pixel's change moves it."""
    array = pixel_values.detach().cpu().contiguous().numpy()
    digest = hashlib.sha256(f"{array.dtype}{array.shape}".encode())
    digest.update(array.tobytes())
    return digest.hexdigest()


class MultiModalProcessor:
    """A vision-language model's image front door.

    Args:
        image_processor: transformers' image processor (``images=[PIL] -> pixel_values [1, 3,
            H, W]``).
        image_token_id: the prompt's image token (one per image before expansion, each
            placeholder after).
        patch_size: the vision tower's patch side in pixels.
        extra_tokens: features per image beyond one per patch (1 for LLaVA's ``full``
            strategy, which keeps the CLS position; 0 for ``default``).
        limits: the most items of each modality one prompt may hold.
        image_token: the image token's text (what a chat's string content gets per image).
        media: where image URLs may be read from (the server's media flags)
    """

    def __init__(
        self,
        image_processor,
        image_token_id: int,
        patch_size: int,
        extra_tokens: int,
        limits: Mapping[str, int],
        image_token: str,
        media: MediaPolicy = DEFAULT_MEDIA,
    ) -> None:
        self.image_processor = image_processor
        self.image_token_id, self.image_token = image_token_id, image_token
        self.patch_size, self.extra_tokens = patch_size, extra_tokens
        self.limits = dict(limits)
        self.media = media

    @classmethod
    def load(
        cls,
        path,
        model_config,
        tokenizer,
        limits: Mapping[str, int],
        media: MediaPolicy = DEFAULT_MEDIA,
    ) -> MultiModalProcessor | None:
        """The processor of a LLaVA-style checkpoint directory (a config with ``vision_config``
        and ``image_token_id``), ``None`` for a text-only model.

        Raises:
            ValueError: no image processor config in ``path`` (naming it).
        """
        vision = getattr(model_config, "vision_config", None)
        token_id = getattr(model_config, "image_token_id", None)
        if vision is None or token_id is None or path is None:
            return None
        from transformers import AutoImageProcessor  # lazy: only vision models need it

        try:
            image_processor = AutoImageProcessor.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError) as exc:
            raise ValueError(
                f"{path}: no image processor (preprocessor_config.json or processor_config.json) "
                f"for this vision-language model ({exc})"
            ) from exc
        full = getattr(model_config, "vision_feature_select_strategy", "default") == "full"
        token = tokenizer.convert_ids_to_tokens([token_id])[0]
        return cls(
            image_processor,
            token_id,
            vision.patch_size,
            int(full),
            limits,
            token,
            media,
        )

    def num_features(self, pixel_values) -> int:
        """Feature vectors (placeholder tokens) the encoder makes of one image ``[1, 3, H,
        W]``: one per ``patch_size`` square, plus :attr:`extra_tokens`."""
        height, width = pixel_values.shape[-2:]
        return (height // self.patch_size) * (width // self.patch_size) + self.extra_tokens

    def preprocess(self, image, param: str):
        """``pixel_values float32 [1, 3, H, W]`` of one PIL image.

        Raises:
            InvalidRequestError: the processor refuses the image (naming ``param``).
        """
        try:
            return self.image_processor(images=[image], return_tensors="pt")["pixel_values"]
        except Exception as exc:  # noqa: BLE001 - any failure is the image's: a 400
            raise InvalidRequestError(
                f"{param}: the image could not be processed ({type(exc).__name__}: {exc})", param
            ) from exc

    def process(
        self, token_ids: list[int], images: Sequence[Any], param: str
    ) -> tuple[list[int], tuple[MultiModalFeatureSpec, ...]]:
        """``token_ids`` with each image token expanded to its image's placeholder run, and the
        images' feature specs in prompt order.

        Raises:
            InvalidRequestError: more images than ``--limit-mm-per-prompt`` allows, or a count
                of images other than the prompt's image tokens (naming ``param``).
        """
        limit = self.limits["image"]
        if len(images) > limit:
            raise InvalidRequestError(
                f"{param}: {len(images)} images, but at most {limit} per prompt are allowed "
                "(--limit-mm-per-prompt)",
                param,
            )
        count = token_ids.count(self.image_token_id)
        if count != len(images):
            raise InvalidRequestError(
                f"{param}: the prompt has {count} image placeholders ({self.image_token!r}) for "
                f"{len(images)} images",
                param,
            )
        if not images:
            return token_ids, ()
        out: list[int] = []
        features = []
        pending = iter(images)
        for token in token_ids:
            if token != self.image_token_id:
                out.append(token)
                continue
            pixel_values = self.preprocess(next(pending), param)
            length = self.num_features(pixel_values)
            features.append(
                MultiModalFeatureSpec(
                    "image",
                    image_hash(pixel_values),
                    PlaceholderRange(len(out), length),
                    {"pixel_values": pixel_values},
                )
            )
            out.extend([self.image_token_id] * length)
        return out, tuple(features)
