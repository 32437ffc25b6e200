"""Images in prompts: the model's own image processor, placeholder expansion and content hashes.

vLLM's multimodal processing is the model: each image of a request is preprocessed once, in the
front door (:class:`~pyxllm.engine.input_processor.InputProcessor`), by transformers' image
processor saved with the checkpoint (``AutoImageProcessor``; without torchvision transformers
falls back to its PIL implementation). The prompt's image token (``<image>``, the config's
``image_token_id``) is replaced by what the model family's processor writes for the image
(:meth:`MultiModalProcessor.expand`; LLaVA: one placeholder token per feature vector of the
image; Idefics3: one run per crop, with its row and column tags; Qwen2-VL: one token per merged
square of patches, on the image's mRoPE grid), and the request carries a
:class:`~pyxllm.multimodal_inputs.MultiModalFeatureSpec` per placeholder run: where it is, the
encoder's inputs (``pixel_values``, Qwen2-VL's ``image_grid_thw`` too) and a hash of them.
The executor runs the encoder once per run's pixels (:mod:`pyxllm.executor.encoder_cache`),
and the hash enters the prefix-cache hash of every
block the run touches (:meth:`pyxllm.engine.request.Request.block_extra_keys`).
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Iterator, Mapping, Sequence
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


def image_hash(data) -> str:
    """Hex SHA-256 of an image's processed encoder inputs: a tensor (``pixel_values``) or a
    dict of them (``{"pixel_values": ..., "image_grid_thw": ...}``), each tensor's name,
    shape, dtype and bytes: equal images processed alike share it, any pixel's change (or
    another grid over the same bytes) moves it."""
    tensors = data.items() if isinstance(data, Mapping) else [("", data)]
    digest = hashlib.sha256()
    for name, tensor in sorted(tensors, key=lambda item: item[0]):
        array = tensor.detach().cpu().contiguous().numpy()
        digest.update(f"{name}{array.dtype}{array.shape}".encode())
        digest.update(array.tobytes())
    return digest.hexdigest()


class MultiModalProcessor:
    """A vision-language model's image front door: the parts every family shares.

    A family (a subclass, picked by :meth:`load` from the config's ``model_type``) says what
    one image becomes, :meth:`expand`: the token ids that replace its image token and the
    encoder inputs behind each placeholder run in them. This class checks the counts, walks
    the prompt and makes the :class:`~pyxllm.multimodal_inputs.MultiModalFeatureSpec` of each
    run, keyed by the hash of its ``pixel_values``.

    Args:
        image_processor: transformers' image processor saved with the checkpoint.
        image_token_id: the prompt's image token (one per image before expansion; every
            placeholder token after).
        limits: the most items of each modality one prompt may hold.
        image_token: the image token's text (what a chat's string content gets per image,
            unless the family wraps it: :attr:`placeholder_text`).
        media: where image URLs may be read from (the server's media flags)
    """

    def __init__(
        self,
        image_processor,
        image_token_id: int,
        limits: Mapping[str, int],
        image_token: str,
        media: MediaPolicy = DEFAULT_MEDIA,
    ) -> None:
        self.image_processor = image_processor
        self.image_token_id, self.image_token = image_token_id, image_token
        # what an image becomes in a chat message's string content (a chat template that does
        # not loop over content parts): the image token, or the text a family's own template
        # writes around it (vLLM's placeholder string)
        self.placeholder_text = image_token
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
        """The processor of a vision-language checkpoint directory (a config with
        ``vision_config`` and ``image_token_id``), of its family's class (Idefics3's for
        ``model_type`` ``idefics3``, SmolVLM2's for ``smolvlm``, Qwen2-VL's for ``qwen2_vl``
        and ``qwen2_5_vl``, else LLaVA's); ``None`` for a text-only model.

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
        token = tokenizer.convert_ids_to_tokens([token_id])[0]
        family = _FAMILIES.get(model_config.model_type, LlavaMultiModalProcessor)
        processor = family(image_processor, token_id, limits, token, media)
        processor.configure(path, model_config, tokenizer)
        return processor

    def configure(self, path, model_config, tokenizer) -> None:
        """Read what the family needs from the checkpoint directory ``path``, its config and
        tokenizer (a hook; nothing here).

        Raises:
            ValueError: ``path`` lacks a file the family needs (naming it).
        """

    def preprocess(self, param: str, **inputs):
        """The image processor's output for ``inputs`` (``images=...`` and its options), as
        torch tensors.

        Raises:
            InvalidRequestError: the processor refuses the image (naming ``param``).
        """
        try:
            return self.image_processor(**inputs, return_tensors="pt")
        except Exception as exc:  # noqa: BLE001 - any failure is the image's: a 400
            raise InvalidRequestError(
                f"{param}: the image could not be processed ({type(exc).__name__}: {exc})", param
            ) from exc

    def expand(self, image, param: str) -> tuple[list[int], list[tuple[int, int, dict]]]:
        """What one PIL image becomes: the token ids that replace its image token, and for
        each placeholder run in them ``(offset in those ids, length, data)``, ``data`` the
        encoder's inputs (``{"pixel_values": [1, 3, H, W]}``), of which it makes ``length``
        feature rows. The family's hook.

        Raises:
            InvalidRequestError: the image processor refuses the image (naming ``param``).
        """
        raise NotImplementedError

    def mrope_grid(self, data: Mapping[str, Any]) -> tuple[int, int, int] | None:
        """The ``(t, h, w)`` mRoPE grid a run with encoder inputs ``data`` fills (see
        :func:`~pyxllm.multimodal_inputs.mrope_positions`); ``None`` (here) for a model with
        1-D positions. The family's hook."""
        return None

    def process(
        self, token_ids: list[int], images: Sequence[Any], param: str
    ) -> tuple[list[int], tuple[MultiModalFeatureSpec, ...]]:
        """``token_ids`` with each image token replaced by its image's :meth:`expand`, and
        the placeholder runs' feature specs in prompt order.

        Raises:
            InvalidRequestError: more images than ``--limit-mm-per-prompt`` allows, or a count
                of images other than the prompt's image tokens (naming ``param``).
        """
        self.check_count(token_ids, images, param)
        if not images:
            return token_ids, ()
        out: list[int] = []
        features: list[MultiModalFeatureSpec] = []
        self.expand_prompt(token_ids, iter(images), param, out, features)
        return out, tuple(features)

    def expand_prompt(
        self,
        token_ids: list[int],
        pending: Iterator[Any],
        param: str,
        out: list[int],
        features: list[MultiModalFeatureSpec],
    ) -> None:
        """:meth:`process`'s work once the images are counted: appends the expanded prompt to
        ``out`` and the placeholder runs' specs to ``features``, taking the images from
        ``pending`` in prompt order (the family's hook)."""
        for token in token_ids:
            if token != self.image_token_id:
                out.append(token)
                continue
            ids, runs = self.expand(next(pending), param)
            for offset, length, data in runs:
                features.append(self.feature_spec(len(out) + offset, length, data))
            out.extend(ids)

    def feature_spec(self, offset: int, length: int, data: dict) -> MultiModalFeatureSpec:
        """The spec of a placeholder run of ``length`` tokens at prompt position ``offset``
        whose encoder inputs are ``data``, keyed by their hash."""
        return MultiModalFeatureSpec(
            "image", image_hash(data), PlaceholderRange(offset, length), data, self.mrope_grid(data)
        )

    def check_count(self, token_ids: list[int], images: Sequence[Any], param: str) -> None:
        """Check a prompt's images against ``--limit-mm-per-prompt`` and its image tokens.

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


class LlavaMultiModalProcessor(MultiModalProcessor):
    """LLaVA's images (``LlavaProcessor``'s expansion): one ``pixel_values [1, 3, H, W]`` per
    image, its image token repeated once per feature, one per ``patch_size`` square plus
    ``extra_tokens`` (1 for the ``full`` strategy, which keeps the CLS position; 0 for
    ``default``)."""

    patch_size = 14
    extra_tokens = 0

    def configure(self, path, model_config, tokenizer) -> None:
        """The tower's patch size and the feature strategy from ``model_config``."""
        self.patch_size = model_config.vision_config.patch_size
        full = getattr(model_config, "vision_feature_select_strategy", "default") == "full"
        self.extra_tokens = int(full)

    def expand(self, image, param: str) -> tuple[list[int], list[tuple[int, int, dict]]]:
        pixel_values = self.preprocess(param, images=[image])["pixel_values"]
        height, width = pixel_values.shape[-2:]
        length = (height // self.patch_size) * (width // self.patch_size) + self.extra_tokens
        return [self.image_token_id] * length, [(0, length, {"pixel_values": pixel_values})]


class Idefics3MultiModalProcessor(MultiModalProcessor):
    """Idefics3's (SmolVLM's) images, split and expanded by transformers' own
    ``Idefics3Processor`` and image processor.

    The image processor cuts an image into ``rows x cols`` crops of the tower's size and adds
    the whole image shrunk to one crop (none cut when the image fits in one, or with
    ``do_image_splitting`` off); the processor's ``replace_image_token`` writes the text that
    replaces the image token (``<fake_token_around_image><row_r_col_c>`` and ``image_seq_len``
    image tokens per crop, a newline per row, then ``<global-img>`` and the global crop's
    tokens). Each crop is encoded on its own (as transformers' vision model does), so each run
    of image tokens is one placeholder run whose ``pixel_values [1, 3, S, S]`` (and
    ``pixel_attention_mask [1, S, S]`` bool, when the image processor pads) are that crop's,
    hashed on their own. An image processed alone is never padded: every crop has the tower's
    full size, and only a batch of several prompts pads, with whole zero crops.
    """

    hf_processor: Any = None
    tokenizer: Any = None
    expansions: dict[tuple[int, int], list[int]]  # token ids by (rows, cols)

    def configure(self, path, model_config, tokenizer) -> None:
        """transformers' ``Idefics3Processor`` saved in ``path`` (its ``image_seq_len``) and
        the tokenizer that writes the expansion's ids.

        Raises:
            ValueError: ``path`` holds no processor config (naming it).
        """
        from transformers import AutoProcessor

        try:
            self.hf_processor = AutoProcessor.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError) as exc:
            raise ValueError(f"{path}: no Idefics3 processor config ({exc})") from exc
        self.tokenizer = tokenizer
        self.expansions = {}

    def image_text(self, out) -> str:
        """The text that replaces the image token for the image processor's output ``out``
        (one image, with ``return_row_col_info``)."""
        return self.hf_processor.replace_image_token(out, 0)

    def expand(self, image, param: str) -> tuple[list[int], list[tuple[int, int, dict]]]:
        out = self.preprocess(param, images=[[image]], return_row_col_info=True)
        crops = out["pixel_values"][0]  # [crops, 3, S, S]: one image
        masks = out.get("pixel_attention_mask")  # [1, crops, S, S], absent without do_pad
        layout = (int(out["rows"][0][0]), int(out["cols"][0][0]))
        ids = self.expansions.get(layout)
        if ids is None:
            text = self.image_text(out)
            ids = self.expansions[layout] = self.tokenizer.encode(text, add_special_tokens=False)
        starts = [
            i
            for i, t in enumerate(ids)
            if t == self.image_token_id and (i == 0 or ids[i - 1] != self.image_token_id)
        ]
        if len(starts) != crops.shape[0]:
            raise ValueError(
                f"{param}: the processor wrote {len(starts)} image token runs for "
                f"{crops.shape[0]} crops (a tokenizer without the Idefics3 image tokens?)"
            )
        runs = []
        for index, (crop, start) in enumerate(zip(crops, starts)):
            end = start
            while end < len(ids) and ids[end] == self.image_token_id:
                end += 1
            data = {"pixel_values": crop[None]}
            if masks is not None:
                data["pixel_attention_mask"] = masks[0, index][None].bool()
            runs.append((start, end - start, data))
        return list(ids), runs


class SmolVLMMultiModalProcessor(Idefics3MultiModalProcessor):
    """SmolVLM2's images: Idefics3's crops, cut by transformers' ``SmolVLMImageProcessor``,
    and Idefics3's expansion, written by transformers' ``get_image_prompt_string`` (what
    ``SmolVLMProcessor.replace_image_token`` calls; that class needs torchvision for its video
    processor and the ``num2words`` package, so it is not loaded)."""

    image_seq_len = 64

    def configure(self, path, model_config, tokenizer) -> None:
        """``image_seq_len`` as ``SmolVLMModel`` computes it from ``model_config`` (features
        per crop: ``(image_size / patch_size)^2 / scale_factor^2``), the tokenizer's image
        tags (``SmolVLMProcessor``'s defaults when it names none) and the tokenizer."""
        vision = model_config.vision_config
        patches = (vision.image_size // vision.patch_size) ** 2
        self.image_seq_len = int(patches / model_config.scale_factor**2)
        self.fake_image_token = getattr(tokenizer, "fake_image_token", "<fake_token_around_image>")
        self.global_image_token = getattr(tokenizer, "global_image_token", "<global-img>")
        self.tokenizer = tokenizer
        self.expansions = {}

    def image_text(self, out) -> str:
        from transformers.models.smolvlm.processing_smolvlm import get_image_prompt_string

        return get_image_prompt_string(
            int(out["rows"][0][0]),
            int(out["cols"][0][0]),
            self.image_seq_len,
            fake_token_around_image=self.fake_image_token,
            image_token=self.image_token,
            global_image_token=self.global_image_token,
        )


class Qwen2VLMultiModalProcessor(MultiModalProcessor):
    """Qwen2-VL's and Qwen2.5-VL's images (``Qwen2VLProcessor``'s expansion, whose class needs
    torchvision for its video half, so the image half is here): transformers' image processor
    resizes the image to multiples of ``patch_size * merge_size`` pixels a side and cuts it
    into patches, ``pixel_values [t * h * w, C]`` on the grid ``image_grid_thw [1, 3]``; the
    image token (``<|image_pad|>``, which the chat template writes between
    ``<|vision_start|>`` and ``<|vision_end|>``) becomes ``t * h * w / merge_size^2``
    placeholder tokens, one per merged square, on the mRoPE grid ``(t, h / merge_size, w /
    merge_size)``."""

    merge_size = 2

    def configure(self, path, model_config, tokenizer) -> None:
        """The vision tower's ``spatial_merge_size`` from ``model_config``, and the image's text
        in string content with the ``<|vision_start|>`` and ``<|vision_end|>`` tokens around it
        (the config's ``vision_start_token_id`` and ``vision_end_token_id``), as Qwen's own
        templates write it and vLLM's placeholder string for these models is."""
        self.merge_size = model_config.vision_config.spatial_merge_size
        ids = (
            getattr(model_config, "vision_start_token_id", None),
            getattr(model_config, "vision_end_token_id", None),
        )
        if None not in ids:
            start, end = tokenizer.convert_ids_to_tokens(list(ids))
            self.placeholder_text = f"{start}{self.image_token}{end}"

    def expand(self, image, param: str) -> tuple[list[int], list[tuple[int, int, dict]]]:
        out = self.preprocess(param, images=[image])
        data = {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}
        t, h, w = self.mrope_grid(data)
        length = t * h * w
        return [self.image_token_id] * length, [(0, length, data)]

    def mrope_grid(self, data: Mapping[str, Any]) -> tuple[int, int, int]:
        t, h, w = (int(n) for n in data["image_grid_thw"][0])
        return t, h // self.merge_size, w // self.merge_size


class Gemma3MultiModalProcessor(MultiModalProcessor):
    """Gemma 3's images, expanded as transformers' ``Gemma3Processor`` expands them.

    The prompt's image token is ``<start_of_image>`` (the config's ``boi_token_id``, what
    Gemma's chat template writes for an image); the processor's ``replace_image_token`` writes
    the text that replaces it, ``\\n\\n<start_of_image>``, ``mm_tokens_per_image``
    ``<image_soft_token>`` (the config's ``image_token_id``: the placeholder run) and
    ``<end_of_image>\\n\\n``; the run's ``pixel_values [1, 3, S, S]`` are the image's. The
    image processor gets the options ``Gemma3Processor`` gives it (its ``images_kwargs``:
    pan-and-scan off whatever the image processor's config says, as transformers' processor
    calls it).

    That text's newlines join the text around the image into tokens of their own (Gemma's
    vocabulary has tokens for runs of newlines; ``user\\n`` then ``\\n\\n`` is one
    ``\\n\\n\\n``), as transformers tokenizes the expanded prompt: so the text between the
    special tokens on either side of an image is decoded, expanded and tokenized again (the
    ids transformers' processor gives for the same text; elsewhere the prompt's ids stay).
    """

    hf_processor: Any = None
    tokenizer: Any = None
    special_ids: frozenset[int] = frozenset()

    def configure(self, path, model_config, tokenizer) -> None:
        """transformers' ``Gemma3Processor`` over the image processor and ``tokenizer``, with
        the model's ``mm_tokens_per_image``, and the prompt's image token: ``<start_of_image>``
        (``boi_token_id``), which string content gets per image.

        Raises:
            ValueError: a tokenizer that does not name Gemma 3's image tokens (``boi_token``,
                ``eoi_token``, ``image_token``, as Gemma's ``tokenizer_config.json`` does).
        """
        from transformers import Gemma3Processor

        try:
            self.hf_processor = Gemma3Processor(
                image_processor=self.image_processor,
                tokenizer=tokenizer,
                image_seq_length=model_config.mm_tokens_per_image,
            )
        except AttributeError as exc:
            raise ValueError(
                f"{path}: the tokenizer does not name Gemma 3's image tokens (boi_token, "
                f"eoi_token, image_token in tokenizer_config.json): {exc}"
            ) from exc
        self.tokenizer = tokenizer
        self.soft_token_id = self.image_token_id
        self.image_token_id = model_config.boi_token_id
        self.image_token = self.placeholder_text = tokenizer.convert_ids_to_tokens(
            [self.image_token_id]
        )[0]
        self.special_ids = frozenset(
            i for i, t in tokenizer.added_tokens_decoder.items() if t.special
        ) - {self.image_token_id}

    def image_text(self, image, param: str) -> tuple[str, list[dict]]:
        """The text that replaces one PIL image's token, and the encoder inputs of each of its
        placeholder runs, in order (with pan-and-scan off: one)."""
        options = getattr(self.hf_processor, "images_kwargs", None) or {}
        out = self.preprocess(param, images=[image], **options)
        text = self.hf_processor.replace_image_token(out, 0)
        return text, [{"pixel_values": crop[None]} for crop in out["pixel_values"]]

    def expand(self, image, param: str) -> tuple[list[int], list[tuple[int, int, dict]]]:
        text, data = self.image_text(image, param)
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return ids, self.runs(ids, data, param)

    def runs(self, ids: list[int], data: list[dict], param: str) -> list[tuple[int, int, dict]]:
        """``(offset, length, data)`` of each run of soft tokens in ``ids``, ``data`` in order.

        Raises:
            ValueError: a count of runs other than ``len(data)`` (a tokenizer without Gemma 3's
                image tokens).
        """
        starts = [
            i
            for i, t in enumerate(ids)
            if t == self.soft_token_id and (i == 0 or ids[i - 1] != self.soft_token_id)
        ]
        if len(starts) != len(data):
            raise ValueError(
                f"{param}: the processor wrote {len(starts)} image token runs for {len(data)} "
                "images and crops (a tokenizer without Gemma 3's image tokens?)"
            )
        runs = []
        for start, item in zip(starts, data):
            end = start
            while end < len(ids) and ids[end] == self.soft_token_id:
                end += 1
            runs.append((start, end - start, item))
        return runs

    def expand_prompt(
        self,
        token_ids: list[int],
        pending: Iterator[Any],
        param: str,
        out: list[int],
        features: list[MultiModalFeatureSpec],
    ) -> None:
        """See :meth:`MultiModalProcessor.expand_prompt`; the text around each image tokenized
        again with it (see the class docstring)."""
        region: list[int] = []  # the ids since the last special token

        def flush() -> None:
            if self.image_token_id not in region:
                out.extend(region)
                return
            decode = functools.partial(self.tokenizer.decode, clean_up_tokenization_spaces=False)
            parts, data, text = [], [], []
            for token in region:
                if token != self.image_token_id:
                    text.append(token)
                    continue
                image_text, image_data = self.image_text(next(pending), param)
                parts += [decode(text), image_text]
                data += image_data
                text = []
            ids = self.tokenizer.encode("".join(parts) + decode(text), add_special_tokens=False)
            for offset, length, item in self.runs(ids, data, param):
                features.append(self.feature_spec(len(out) + offset, length, item))
            out.extend(ids)

        for token in token_ids:
            if token in self.special_ids:
                flush()
                region.clear()
                out.append(token)
            else:
                region.append(token)
        flush()


# the processor of each vision-language model_type but LLaVA's (the default)
_FAMILIES: dict[str, type[MultiModalProcessor]] = {
    "idefics3": Idefics3MultiModalProcessor,
    "smolvlm": SmolVLMMultiModalProcessor,
    "qwen2_vl": Qwen2VLMultiModalProcessor,
    "qwen2_5_vl": Qwen2VLMultiModalProcessor,
    "qwen3_vl": Qwen2VLMultiModalProcessor,
    "gemma3": Gemma3MultiModalProcessor,
}
