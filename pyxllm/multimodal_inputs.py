"""A prompt's multimodal items as the engine carries them (vLLM's ``MultiModalFeatureSpec``).

An image becomes a run of placeholder tokens in the prompt (one per feature vector the model's
encoder makes of it) and a :class:`MultiModalFeatureSpec` saying where that run is, what the
encoder reads (``pixel_values``) and the image's content hash, which keys the executor's encoder
cache and enters the prefix-cache hash of every KV block the run touches. Values only: no model
code, so the engine, the scheduler and the executor all pass it along.

A model with multimodal rotary positions (mRoPE: Qwen2-VL, Qwen2.5-VL) gives each image's run
a grid (:attr:`MultiModalFeatureSpec.mrope_grid`); :func:`mrope_positions` places a prompt's
tokens on it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

import torch


@dataclass(frozen=True, slots=True)
class MediaPolicy:
    """Where image URLs in requests may be read from (the server's media flags).

    Attributes:
        allowed_local_media_path: the directory ``file://`` URLs may be read from, and below
            (``--allowed-local-media-path``); ``None``: none.
        fetch_media: whether ``http(s)://`` URLs are fetched (``--fetch-media``).
        allowed_media_domains: the host names ``http(s)://`` URLs (and every redirect) may
            name (``--allowed-media-domains``, vLLM's flag); empty: any host.
    """

    allowed_local_media_path: str | None = None
    fetch_media: bool = True
    allowed_media_domains: tuple[str, ...] = ()

    def allows_host(self, url: str) -> bool:
        """Whether ``url``'s host may be fetched (any host when no domains are set)."""
        host = (urlparse(url).hostname or "").lower()
        return not self.allowed_media_domains or host in self.allowed_media_domains


DEFAULT_MEDIA = MediaPolicy()  # the flags' defaults: http(s) fetched, no file:// URLs
NO_MEDIA_URLS = MediaPolicy(fetch_media=False)  # data: URLs only


@dataclass(frozen=True, slots=True)
class PlaceholderRange:
    """Where an item's placeholder tokens are in the prompt: ``[offset, offset + length)``."""

    offset: int
    length: int

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass(frozen=True, slots=True)
class MultiModalFeatureSpec:
    """One multimodal item of a request.

    Attributes:
        modality: ``"image"``.
        identifier: the item's content hash (hex SHA-256 of its processed ``pixel_values``):
            equal images share encoder outputs and prefix-cache blocks, different ones never.
        mm_position: its placeholder run in the prompt; the encoder makes exactly
            ``mm_position.length`` feature vectors of it.
        data: what the model's encoder reads, e.g. ``{"pixel_values": float32 [1, 3, H, W]}``
            (CPU tensors, as the model's image processor made them).
        mrope_grid: for a model with mRoPE positions, the ``(t, h, w)`` grid its placeholder
            tokens fill, in order (``t * h * w == mm_position.length``; see
            :func:`mrope_positions`); ``None`` for a model with 1-D positions.
    """

    modality: str
    identifier: str
    mm_position: PlaceholderRange
    data: dict[str, Any]
    mrope_grid: tuple[int, int, int] | None = None

    def overlap(self, start: int, end: int) -> tuple[int, int] | None:
        """The part ``[lo, hi)`` of its placeholder run inside the token range ``[start, end)``
        (prompt positions), ``None`` when they do not meet."""
        lo, hi = max(start, self.mm_position.offset), min(end, self.mm_position.end)
        return (lo, hi) if lo < hi else None


def mrope_positions(
    features: Sequence[MultiModalFeatureSpec], start: int, end: int
) -> torch.Tensor:
    """The multimodal rotary positions (mRoPE; Qwen2-VL's ``get_rope_index`` in transformers,
    vLLM's ``MRotaryEmbedding.get_input_positions``) of a sequence's tokens ``[start, end)``,
    whose images are ``features`` (in prompt order; those without a grid are ignored).

    Each token gets a ``(temporal, height, width)`` triple. A text token's three are equal: its
    index in the sequence, shifted by what the images before it took off. An image's tokens
    fill its ``mrope_grid`` ``(t, h, w)`` row by row, token ``i`` of the run at ``(base + i //
    (h * w), base + i // w % h, base + i % w)``, ``base`` the position the image's first token
    would have as text; the text after it continues from ``base + max(h, w)`` (transformers'
    rule; for an image ``t`` is 1) instead of ``base + t * h * w``. Generated tokens are text
    after every image, so a decode step's position is its index plus the prompt's total shift
    (transformers' ``rope_deltas``).

    Returns:
        ``int64 [3, end - start]``.
    """
    out = torch.empty(3, end - start, dtype=torch.long)
    shift, cursor = 0, start  # what the images before ``cursor`` took off; next token unset

    def text(lo: int, hi: int) -> None:
        out[:, lo - start : hi - start] = torch.arange(lo + shift, hi + shift)

    for feature in features:
        if feature.mrope_grid is None:
            continue
        offset, length = feature.mm_position.offset, feature.mm_position.length
        if offset >= end:
            break
        if cursor < offset:
            text(cursor, offset)
            cursor = offset
        t, h, w = feature.mrope_grid
        hi = min(offset + length, end)
        if cursor < hi:
            index = torch.arange(cursor - offset, hi - offset)
            grid = torch.stack((index // (h * w), index // w % h, index % w))
            out[:, cursor - start : hi - start] = grid + (offset + shift)
            cursor = hi
        shift += max(h, w) - length
        cursor = max(cursor, offset + length)
    if cursor < end:
        text(cursor, end)
    return out
